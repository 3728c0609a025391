"""The reads (or writes) of one chunk of ``OffloadedOptimizer.step``, and what to do once done."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from parts.offload.spares import Spares
from parts.offload.store import IOHandle


class Batch:
    """The reads (or writes) of one chunk and what to do once they are done (``keep``: tensors
    the writes read from, given back to ``spares`` if any)."""

    def __init__(self, spares: Optional[Spares] = None, params: tuple[int, ...] = ()) -> None:
        self.params = params  # ids of the chunk's parameters
        self.handles: list[IOHandle] = []
        self.after: list[Callable[[], None]] = []
        self.keep: list[torch.Tensor] = []
        self.spares = spares

    @property
    def done(self) -> bool:
        """True once every transfer has finished (``finish`` would not wait)."""
        return all(h.done for h in self.handles)

    def absorb(self, other: "Batch") -> None:
        """Take over ``other``'s transfers, actions and buffers (finished with this one's)."""
        self.handles += other.handles
        self.after += other.after
        self.keep += other.keep
        other.handles, other.after, other.keep = [], [], []

    def finish(self) -> None:
        """Wait for the transfers, run the ``after`` actions, give the ``keep`` buffers back."""
        for h in self.handles:
            h.wait()
        for fn in self.after:
            fn()
        if self.spares is not None:
            for t in self.keep:
                self.spares.give(t)
        self.handles, self.after, self.keep = [], [], []


def discard(batch: Optional[Batch], spares: Spares) -> None:
    """Wait for a batch of reads and give its buffers back to ``spares`` (nothing installed)."""
    if batch is not None:
        batch.after, batch.spares = [], spares
        batch.finish()


def finish_quietly(batch: Batch) -> None:
    """Finish ``batch`` whatever its transfers met (a step being rolled back discards them)."""
    for handle in batch.handles:
        with contextlib.suppress(Exception):
            handle.wait()
    batch.handles = []
    batch.finish()


def discard_quietly(batch: Batch, spares: Spares) -> None:
    """``discard`` a batch of reads whatever they met."""
    for handle in batch.handles:
        with contextlib.suppress(Exception):
            handle.wait()
    batch.handles = []
    discard(batch, spares)
