"""Pure-torch implementations of the parts.csrc ops (the fallback and the test oracle)."""

from __future__ import annotations

from typing import Sequence

import torch

from ._validate import check_copy_in, check_copy_out, check_flatten, check_unflatten


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate `tensors` into one new 1-D tensor."""
    check_flatten(tensors)
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Return views into `flat` with the shapes of `like`, laid out back to back."""
    check_unflatten(flat, like)
    out, offset = [], 0
    for t in like:
        n = t.numel()
        out.append(flat.narrow(0, offset, n).view(t.shape))
        offset += n
    return out


def copy_in(srcs: Sequence[torch.Tensor], dst: torch.Tensor, offsets: Sequence[int]) -> None:
    """Copy each srcs[i] (flattened) into dst at element offset offsets[i]."""
    check_copy_in(srcs, dst, offsets)
    flat = dst.view(-1)
    for s, off in zip(srcs, offsets):
        flat.narrow(0, off, s.numel()).copy_(s.reshape(-1))


def copy_out(src: torch.Tensor, dsts: Sequence[torch.Tensor], world_size: int,
             offsets: Sequence[int], shard_numels: Sequence[int]) -> None:
    """Gather each dsts[i] from its shard in every rank's chunk of `src`, dropping padding."""
    check_copy_out(src, dsts, world_size, offsets, shard_numels)
    chunks = src.view(world_size, -1)
    for d, off, n in zip(dsts, offsets, shard_numels):
        flat, m = d.view(-1), d.numel()
        rows = m // n if n else 0  # ranks whose whole shard lands in dsts[i]
        if rows:
            flat[: rows * n].view(rows, n).copy_(chunks[:rows, off : off + n])
        if m - rows * n:  # the last rank holding data contributes a partial shard
            flat[rows * n :].copy_(chunks[rows, off : off + m - rows * n])
