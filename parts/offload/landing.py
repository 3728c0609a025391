"""Landing grads of parked tensors in reused memory: a reduce-scatter's output for a grad
that a step during backward consumes takes a block the store's ``reuse`` kept (pages written
before: no page faults), and ``give_back`` returns it once the step is done with it."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from parts.offload._fileio import ALIGN, aligned_empty, worth_aligning
from parts.offload.parking import empty_for_io, parked
from parts.offload.staging import staging

_POOL = "_parts_reuse"  # on a grad buffer whose memory ``give_back`` returns to its store's ``reuse``


def grad_buffer(t: torch.Tensor, numel: int, dtype: torch.dtype,
                alloc: Optional[Callable[[int, torch.dtype], torch.Tensor]] = None) -> torch.Tensor:
    """A 1-D ``ALIGN``-aligned buffer for a grad of parked ``t`` landing (a reduce-scatter's output),
    its memory a block the store's ``reuse`` kept if it has one of that size (written before: no
    page faults), else fresh from ``alloc``; ``give_back`` returns it once its holder is done."""
    nbytes = numel * dtype.itemsize
    if not worth_aligning(nbytes) or ALIGN % dtype.itemsize:
        return empty_for_io((numel,), dtype, alloc)
    pool = parked(t).store.reuse
    block = pool.take(nbytes + ALIGN, torch.device("cpu"))
    if block is None:
        buf = aligned_empty(numel, dtype, alloc)
    else:
        start = (-block.data_ptr()) % ALIGN // dtype.itemsize
        buf = torch.empty(0, dtype=dtype, device="cpu").set_(block, start, (numel,))
    if buf.untyped_storage().nbytes() == nbytes + ALIGN:  # one block of the size ``take`` asks for
        buf.__dict__[_POOL] = pool
    return buf


def give_back(buf: torch.Tensor) -> None:
    """Return the memory of a ``grad_buffer`` to its store's ``reuse`` (its storage is empty after:
    nothing may use ``buf`` or a view of it again); nothing for any other tensor."""
    pool = getattr(buf, "__dict__", {}).pop(_POOL, None)
    if pool is not None:
        staging.wait(buf)  # a copy from the device may still fill it
        pool.give(buf.untyped_storage())
