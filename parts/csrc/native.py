"""The C++ implementations of the parts.csrc ops (torch.ops.parts.*), with Python-side checks.

Each function builds/loads the extension on first use and raises NativeUnavailable when it
cannot; the package-level functions in parts.csrc choose between these and parts.csrc.reference.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._build import NativeUnavailable, load_native
from ._validate import check_copy_in, check_copy_out, check_flatten, check_unflatten


def available() -> bool:
    """True if the native ops are built and loaded (builds them on the first call)."""
    try:
        load_native()
    except NativeUnavailable:
        return False
    return True


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate `tensors` into one new 1-D tensor (native kernel)."""
    check_flatten(tensors)
    load_native()
    return torch.ops.parts.flatten(list(tensors))


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Return views into `flat` with the shapes of `like` (native composite op)."""
    check_unflatten(flat, like)
    load_native()
    numels, sizes = [], []
    for t in like:
        numels.append(t.numel())
        sizes.append(t.dim())
        sizes.extend(t.shape)
    return torch.ops.parts.unflatten(flat, numels, sizes)


def copy_in(srcs: Sequence[torch.Tensor], dst: torch.Tensor, offsets: Sequence[int]) -> None:
    """Copy each srcs[i] (flattened) into dst at element offset offsets[i] (native kernel)."""
    check_copy_in(srcs, dst, offsets)
    load_native()
    torch.ops.parts.copy_in(list(srcs), dst, [int(o) for o in offsets])


def copy_out(src: torch.Tensor, dsts: Sequence[torch.Tensor], world_size: int,
             offsets: Sequence[int], shard_numels: Sequence[int]) -> None:
    """Gather each dsts[i] from its shard in every chunk of `src`, dropping padding (native)."""
    check_copy_out(src, dsts, world_size, offsets, shard_numels)
    load_native()
    torch.ops.parts.copy_out(src, list(dsts), int(world_size),
                             [int(o) for o in offsets], [int(n) for n in shard_numels])
