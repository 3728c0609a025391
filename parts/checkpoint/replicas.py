"""Replica check: are the activations to partition identical on every rank of the group?

Pure functions (no ``torch.distributed``): a position-aware checksum of a tensor's bytes
and the comparison of the checksums that the ranks all-gathered. A checksum can collide,
so a pass means "very likely identical"; a failure is always a real difference.
"""

from __future__ import annotations

import torch

_MODULUS = 65521  # largest prime below 2**16: weights stay small, sums stay exact in int64


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of ``tensor``'s bytes: plain and weighted by position (mod 65521, plus 1)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    weights = torch.arange(data.numel(), dtype=torch.int64, device=data.device) % _MODULUS + 1
    return torch.stack([data.sum(), (data * weights).sum()])


def differing_ranks(gathered: torch.Tensor) -> dict[int, list[int]]:
    """From (ranks, tensors, 2) checksums: per tensor index, the ranks that differ from rank 0."""
    out: dict[int, list[int]] = {}
    for index in range(gathered.shape[1]):
        ref = gathered[0, index]
        ranks = [r for r in range(1, gathered.shape[0]) if not torch.equal(gathered[r, index], ref)]
        if ranks:
            out[index] = ranks
    return out


def replica_error(paths: list[str], differing: dict[int, list[int]], group_ranks: list[int]) -> str:
    """The message naming each differing argument and the ranks that hold other values."""
    lines = [f"  {paths[i]}: group ranks {ranks} differ from group rank 0"
             for i, ranks in sorted(differing.items())]
    return ("checkpoint(check_replicated=True): activations to partition are not identical "
            f"across the partition group (global ranks {group_ranks}):\n" + "\n".join(lines))
