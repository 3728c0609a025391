"""Flat ranges of an n-D tensor as row-aligned boxes: pure arithmetic, no torch.

A rank owns a flat range ``[start, stop)`` of a row-major tensor of ``shape``. A checkpoint
planner (torch.distributed.checkpoint) describes pieces of a tensor as boxes (an offset and
a size per dimension). A flat range of a 2-D tensor is at most three boxes: the tail of a
partial first row, the full rows, the head of a partial last row; of an n-D tensor at most
``2 * ndim - 1`` (the same split applied to the partial rows, one dimension down). Every box
is contiguous in flat order, so it is a view of the flat range, never a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Sequence


@dataclass(frozen=True)
class Box:
    """A box ``offsets``/``sizes`` of the tensor, stored at flat positions ``[flat_start, flat_start + numel)``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int

    @property
    def numel(self) -> int:
        """Elements in the box."""
        return prod(self.sizes)


def _split(shape: tuple[int, ...], start: int, stop: int, prefix: tuple[int, ...], base: int) -> list[Box]:
    """Boxes of ``[start, stop)`` (flat, relative to ``base``) inside a block of ``shape`` at index ``prefix``."""
    if start >= stop:
        return []
    if not shape:
        return [Box(prefix, (), base + start)]
    rest = shape[1:]
    row = prod(rest)
    first, last = divmod(start, row), divmod(stop, row)
    if first[0] == last[0]:  # inside one row: one dimension down
        return _split(rest, first[1], last[1], prefix + (first[0],), base + first[0] * row)
    out: list[Box] = []
    lo = first[0]
    if first[1]:  # partial first row
        out += _split(rest, first[1], row, prefix + (lo,), base + lo * row)
        lo += 1
    if last[0] > lo:  # full rows
        out.append(Box(prefix + (lo,) + (0,) * len(rest), (1,) * len(prefix) + (last[0] - lo,) + rest,
                       base + lo * row))
    if last[1]:  # partial last row
        out += _split(rest, 0, last[1], prefix + (last[0],), base + last[0] * row)
    return out


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The row-aligned boxes covering the flat range ``[start, stop)`` of a tensor of ``shape``, in flat order."""
    shape = tuple(int(d) for d in shape)
    numel = prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"flat range [{start}, {stop}) is outside a tensor of shape {shape} ({numel} elements)")
    return _split(shape, start, stop, (), 0)
