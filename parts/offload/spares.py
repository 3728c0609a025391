"""Spare buffers: memory a finished chunk of ``OffloadedOptimizer.step`` gives back, for the
reads of a later chunk (of the same step or the next).

A buffer the store reads into is otherwise fresh memory, and fresh memory costs a page
fault and a zeroed page per 4 KiB at its first touch, inside the read: CPU time taken from
compute, and a slower read (``benchmarks/bench_offload.py`` measures both). A step's chunks repeat
the same tensor sizes (a model's
layers repeat), so the state and grad buffers of chunk k-1, free once its writes are done,
take the reads of chunk k+2. Only tensors this pool made come back (never one someone else
may hold), matched by exact byte size. A miss first drops at least as many spare bytes as
it allocates, so spares plus lent buffers never exceed the most ever lent at once (at most
three chunks): the step's memory bound holds. The spares stay from one step to the next
(``forget`` at the end of a step: the next step's reads, the ones started ahead of it
included, land in memory touched before); the buffers a step carries over (writes behind,
reads ahead) stay lent, to come back in the next. ``clear`` frees them all.
"""

from __future__ import annotations

from typing import Iterable

import torch

from parts.offload._fileio import aligned_empty, worth_aligning


class Spares:
    """Aligned buffers by byte size, handed out by ``empty`` and taken back by ``give``."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}  # nbytes -> flat uint8 buffers
        self._lent: dict[int, torch.Tensor] = {}  # id -> a tensor handed out (kept: ids stay unique)
        self.spare_bytes = 0
        self.reused = 0  # buffers handed out again (for tests and benchmarks)

    @property
    def held_bytes(self) -> int:
        """Bytes of the spares and of the buffers handed out and not yet given back."""
        return self.spare_bytes + sum(t.numel() * t.element_size() for t in self._lent.values())

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` for a store read: a spare of its size, else fresh."""
        nbytes = shape.numel() * dtype.itemsize
        if not worth_aligning(nbytes):
            return torch.empty(shape, dtype=dtype, device="cpu")
        same = self._free.get(nbytes)
        if same:
            base = same.pop()
            self.spare_bytes -= nbytes
            self.reused += 1
        else:
            self._drop(nbytes)
            base = aligned_empty(nbytes, torch.uint8)
        t = base.view(dtype).view(shape)
        self._lent[id(t)] = t
        return t

    def give(self, t: torch.Tensor) -> None:
        """Take back ``t`` if this pool made it (its holder is done with it), else nothing."""
        if self._lent.get(id(t)) is not t:
            return
        del self._lent[id(t)]
        base = t.reshape(-1).view(torch.uint8)
        self._free.setdefault(base.numel(), []).append(base)
        self.spare_bytes += base.numel()

    def forget(self, still_lent: Iterable[torch.Tensor] = ()) -> None:
        """Forget what was handed out, except ``still_lent`` (buffers a step carries over to the
        next: they come back when their holder is done); the spares stay for the next step."""
        self._lent = {id(t): t for t in still_lent if self._lent.get(id(t)) is t}

    def clear(self) -> None:
        """Free every spare and forget everything handed out."""
        self._free, self._lent, self.spare_bytes = {}, {}, 0

    def _drop(self, nbytes: int) -> None:
        """Free spares of at least ``nbytes`` (or all of them)."""
        dropped = 0
        for size in sorted(self._free, reverse=True):
            bufs = self._free[size]
            while bufs and dropped < nbytes:
                bufs.pop()
                dropped += size
            if dropped >= nbytes:
                break
        self._free = {size: bufs for size, bufs in self._free.items() if bufs}
        self.spare_bytes -= dropped
