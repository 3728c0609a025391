"""Pure arithmetic: which rows of a tensor hold a flat range of its elements.

A rank's shard of a parameter is the flat range ``layout.range(rank)`` of the row-major
tensor. A safetensors slice reads along dimension 0, so the smallest read covering that
range is the rows ``[first, last)`` below; the rank then narrows ``start - first * row``.
"""

from __future__ import annotations

import math
from typing import Sequence


def covering_rows(shape: Sequence[int], start: int, stop: int) -> tuple[int, int, int]:
    """``(first_row, stop_row, offset)``: rows ``[first_row, stop_row)`` of a tensor of ``shape``
    hold its flat elements ``[start, stop)``, from ``offset`` in their flattened read.

    A 0-d tensor is one "row" of one element. An empty range reads no rows.
    """
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"covering_rows: range [{start}, {stop}) outside a tensor of {numel} elements")
    if stop == start:
        return 0, 0, 0
    if len(shape) == 0:
        return 0, 1, 0
    row = numel // shape[0]
    first, last = start // row, -(-stop // row)
    return first, last, start - first * row
