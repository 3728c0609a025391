"""Make tensors equal to group rank 0's, sending only those that differ.

``broadcast_differing(pieces, info, extra)`` exchanges two 64-bit checksums per piece (and an
integer of rank 0's, ``extra``) over the group; the pieces whose checksums are not the same on
every rank are then broadcast from rank 0 in one buffer. Every rank computes the same list
from the same gathered checksums, so the broadcast, when there is one, matches on every rank.
Replicas built from the same seed, or loaded from the same checkpoint, send only the checksums.

``checksum`` is plain arithmetic on the bytes: two sums of 64-bit words, each word multiplied
by an odd weight that depends on its position (wrapping, so the order of summation does not
matter): equal bytes give equal sums; any changed, moved or swapped word changes them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from parts.comm.collectives import all_gather_list, broadcast, comm_device
from parts.comm.group import GroupInfo

_WEIGHTS = ((-7046029254386353131, 1442695040888963407), (-4658895280553007687, 6364136223846793005))
"""Two (multiplier, offset) pairs: a word at position i counts (i * multiplier + offset) | 1 times."""
_CHUNK = 1 << 20  # words per pass: bounded extra memory


def checksum(data: torch.Tensor) -> torch.Tensor:
    """Two position-weighted 64-bit sums of the bytes of contiguous ``data``: an int64 tensor of 2."""
    raw = data.reshape(-1).view(torch.uint8)
    pad = (-raw.numel()) % 8
    if pad or raw.storage_offset() % 8:  # whole words from an aligned start
        raw = torch.cat([raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)])
    words = raw.view(torch.int64)
    out = torch.zeros(2, dtype=torch.int64, device=raw.device)
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start:start + _CHUNK]
        position = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=raw.device)
        for k, (multiplier, offset) in enumerate(_WEIGHTS):
            out[k] += (chunk * ((position * multiplier + offset) | 1)).sum()
    return out


def differing(pieces: Sequence[torch.Tensor], info: GroupInfo, extra: int = 0) -> tuple[list[int], int]:
    """The indices of ``pieces`` whose bytes are not the same on every rank of ``info``, and
    group rank 0's ``extra`` (one all-gather of two checksums per piece)."""
    sums = [checksum(p) for p in pieces]
    mine = torch.cat(sums + [torch.tensor([extra], dtype=torch.int64, device=sums[0].device if sums else "cpu")])
    every = all_gather_list(mine.to(comm_device(info)), info)
    first = every[0].cpu()
    others = [e.cpu() for e in every[1:]]
    differ = [k for k in range(len(pieces))
              if any(not torch.equal(e[2 * k:2 * k + 2], first[2 * k:2 * k + 2]) for e in others)]
    return differ, int(first[-1])


def broadcast_differing(pieces: Sequence[torch.Tensor], info: GroupInfo, extra: int = 0) -> int:
    """Overwrite the 1-D byte ``pieces`` that differ across ``info`` with group rank 0's (one
    broadcast of those alone; none if all agree); returns rank 0's ``extra``."""
    differ, first_extra = differing(pieces, info, extra)
    if not differ:
        return first_extra
    buf = torch.cat([pieces[k] for k in differ])
    broadcast(buf, 0, info)
    with torch.no_grad():
        torch.split_with_sizes_copy(buf, [pieces[k].numel() for k in differ], out=[pieces[k] for k in differ])
    return first_extra
