"""Preallocated per-layer buffers for saved activations (``ContiguousBuffers``).

Saving a fresh tensor per checkpointed layer per step fragments an accelerator's caching
allocator: the saved shares live from forward to backward while the activations around
them come and go. ``ContiguousBuffers(num_layers)`` gives the k-th checkpoint call of a
step (k < ``num_layers``) its own byte buffer, allocated on first use (grown if a later
step needs more) and reused every step. Call ``reset()`` at the start of every step; the
call past ``num_layers`` raises. A checkpoint whose slot was reset before its backward ran
raises instead of reading another step's data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

ALIGN_BYTES = 64


def aligned(nbytes: int, align: int = ALIGN_BYTES) -> int:
    """``nbytes`` rounded up to a multiple of ``align``."""
    return -(-nbytes // align) * align


@dataclass(frozen=True)
class Slot:
    """A region handed out for one checkpoint call: layer index and the step it belongs to."""

    layer: int
    generation: int
    data: torch.Tensor  # uint8, exactly the bytes requested (aligned)


class ContiguousBuffers:
    """One reusable byte buffer per checkpointed layer; ``reset()`` every step."""

    def __init__(self, num_layers: int) -> None:
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"ContiguousBuffers: num_layers must be an int >= 1, got {num_layers!r}")
        self.num_layers = num_layers
        self._buffers: list[Optional[torch.Tensor]] = [None] * num_layers
        self._next = 0
        self._generation = 0
        self.allocations = 0  # buffer (re)allocations so far: num_layers after a steady first step

    def reset(self) -> None:
        """Start a new step: the next checkpoint call gets layer 0 again."""
        self._next = 0
        self._generation += 1

    @property
    def used(self) -> int:
        """Layers handed out since the last reset."""
        return self._next

    def nbytes(self) -> int:
        """Bytes held by all allocated buffers."""
        return sum(b.numel() for b in self._buffers if b is not None)

    def take(self, nbytes: int, device: torch.device, pin_memory: bool = False) -> Slot:
        """The next layer's buffer as ``nbytes`` bytes on ``device``; raises when exhausted."""
        if self._next >= self.num_layers:
            raise RuntimeError(
                f"ContiguousBuffers(num_layers={self.num_layers}) exhausted: checkpoint call "
                f"{self._next + 1} since the last reset(); call buffers.reset() at the start of "
                f"every step, or create it with num_layers >= the checkpointed layers per step")
        layer = self._next
        buf = self._buffers[layer]
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device,
                              pin_memory=pin_memory)
            self._buffers[layer] = buf
            self.allocations += 1
        self._next += 1
        return Slot(layer, self._generation, buf[:nbytes])

    def check(self, slot: Slot) -> None:
        """Raise if ``slot``'s step has been reset since it was filled."""
        if slot.generation != self._generation:
            raise RuntimeError(
                f"ContiguousBuffers: layer {slot.layer} was reset (step {slot.generation} -> "
                f"{self._generation}) before the backward of the checkpoint that filled it; "
                f"call reset() only after backward")
