"""Fixed-point sums: integers add up to the same bits in any order, floats do not.

Reproducible mode (``attach(model, reproducible=True)``) sums gradients as int64. One unit's
(one micro-batch's) full grad of a parameter is quantized at an exponent ``e`` chosen from
that unit's own largest magnitude alone: ``q = round(g * 2**e)``, with ``|q| < 2**UNIT_BITS``.
Scaling by a power of two is exact in float64 and the rounding is one round-half-even, so
``q`` depends on the unit's grad only, never on the world size or on which units meet in a
collective. ``e`` lies on a grid of ``GRID`` bits, so units of similar magnitude share it;
sums are kept per exponent (``dequantize`` adds them in ascending exponent order). Up to
``MAX_UNITS`` units fit one sum without overflow (``2**UNIT_BITS * MAX_UNITS <= 2**62``).

Resolution: the grid puts a unit's largest magnitude in ``[2**34, 2**50)`` after scaling, so
each element of a unit is rounded by at most ``max|g| * 2**-35``; an fp32 sum rounds by up to
``2**-24`` of the running sum at every addition.

Sums of squares (the grad norm of clipping) use one global exponent from the largest square
and the element count, with the remainder of each element in a second word (``split_squares``).
Pure arithmetic: no collectives here.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import torch


UNIT_BITS = 50
"""A unit's quantized grad stays below ``2**UNIT_BITS`` in magnitude."""
MAX_UNITS = 4096
"""Units one fixed-point sum holds without overflow: ``2**UNIT_BITS * MAX_UNITS <= 2**62``."""
GRID = 16
"""Exponents are multiples of ``GRID``: units of similar magnitude share one."""
MAX_EXPONENT = 960
"""The largest exponent (``2.0 ** 960`` is finite); smaller grads round to zero."""


def unit_exponent(max_abs: float) -> Optional[int]:
    """The exponent a unit whose largest magnitude is ``max_abs`` quantizes at (None for an all-zero
    grad): the largest multiple of ``GRID`` with ``max_abs * 2**e < 2**UNIT_BITS``."""
    if max_abs == 0.0:
        return None
    if not math.isfinite(max_abs):
        raise ValueError(f"unit_exponent: max_abs must be finite, got {max_abs}")
    _, top = math.frexp(max_abs)  # max_abs < 2**top
    return min(MAX_EXPONENT, ((UNIT_BITS - top) // GRID) * GRID)


def largest(tensors: Sequence[torch.Tensor]) -> list[float]:
    """The largest magnitude of each tensor (0.0 for an empty one; nan or inf where it holds one): one
    ``aminmax`` per tensor (a max is exact; far cheaper than an inf-norm kernel) and one read to the
    host per device."""
    out = [0.0] * len(tensors)
    kinds: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            kinds.setdefault(t.device, []).append(i)
    for index in kinds.values():
        tops = torch.stack([_top(tensors[i]) for i in index]).tolist()
        for i, top in zip(index, tops):
            out[i] = top
    return out


def _top(t: torch.Tensor) -> torch.Tensor:
    """``max |t|`` as a float64 scalar (nan if ``t`` holds one)."""
    low, high = torch.aminmax(t.reshape(-1))
    return torch.maximum(high.to(torch.float64), low.to(torch.float64).neg())


def quantize(values: torch.Tensor, exponent: int) -> torch.Tensor:
    """``round(values * 2**exponent)`` as int64: ``quantized_row_sum`` of one row."""
    flat = values.reshape(1, -1)
    return quantized_row_sum(flat, piece_scales([exponent], [flat.shape[1]], values.device))


def piece_scales(exponents: Sequence[Optional[int]], sizes: Sequence[int], device: torch.device) -> torch.Tensor:
    """``2**e`` for every element of consecutive pieces of ``sizes`` elements quantized at
    ``exponents`` (0 where None): fp32 where every exponent lies in ``[0, 100]`` (a power-of-two
    product of an fp32 or narrower value below ``2**UNIT_BITS`` is then exact in fp32, as in float64,
    at half the bytes), else float64."""
    present = [e for e in exponents if e is not None]
    dtype = torch.float32 if all(0 <= e <= 100 for e in present) else torch.float64
    per_piece = torch.tensor([0.0 if e is None else 2.0 ** e for e in exponents], dtype=dtype)
    return per_piece.repeat_interleave(torch.tensor(sizes)).to(device)


def quantized_row_sum(rows: torch.Tensor, scales: torch.Tensor, chunk: int = 1 << 18) -> torch.Tensor:
    """``sum_r round(rows[r] * scales)`` as int64: per element an exact scaling by a power of two and
    one rounding (half to even), the integer sums exact; in column pieces of ``chunk`` that stay in cache."""
    work = torch.promote_types(rows.dtype, scales.dtype)
    total = torch.empty(rows.shape[1], dtype=torch.int64, device=rows.device)
    for start in range(0, rows.shape[1], chunk):
        scale, out = scales[start:start + chunk], total[start:start + chunk]
        out.copy_((rows[0, start:start + chunk].to(work) * scale).round_())
        for row in rows[1:]:
            out.add_((row[start:start + chunk].to(work) * scale).round_().to(torch.int64))
    return total


def dequantize(sums: Mapping[int, torch.Tensor], dtype: torch.dtype, numel: int,
               device: torch.device) -> torch.Tensor:
    """``sum_e sums[e] * 2**-e`` in float64, added in ascending ``e``, then cast to ``dtype``: the same
    bits wherever the same sums are."""
    order = sorted(sums)
    if not order:
        return torch.zeros(numel, dtype=dtype, device=device)
    total = sums[order[0]].to(torch.float64).mul_(2.0 ** -order[0])
    for e in order[1:]:
        total.add_(sums[e].to(torch.float64).mul_(2.0 ** -e))
    return total.to(dtype)


def square_exponents(max_square: float, count: int) -> tuple[int, int]:
    """``(e, e_low)`` for ``split_squares`` over ``count`` elements whose largest square is ``max_square``:
    ``count * max_square * 2**e < 2**62`` and the second word's ``count * 2**(e_low - e) < 2**62``."""
    bits = max(1, count).bit_length()  # count < 2**bits
    _, top = math.frexp(max_square) if max_square > 0 else (0.0, 0)
    e = min(MAX_EXPONENT, 62 - bits - top)
    return e, e + (61 - bits)


def split_squares(values: torch.Tensor, e: int, e_low: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 sums of ``floor(v*v * 2**e)`` and of the rounded remainders at ``2**e_low``: the square
    of an fp32 or bf16 value is exact in float64, so both sums are a function of the multiset of values."""
    scaled = values.to(torch.float64).square_().mul_(2.0 ** e)
    high = scaled.sum(dtype=torch.int64)  # each element cast first: truncated, its floor (squares are >= 0)
    low = scaled.frac_().mul_(2.0 ** (e_low - e)).round_()  # the remainder in [0, 1) is exact
    return high, low.sum(dtype=torch.int64)


def join_squares(high: int, low: int, e: int, e_low: int) -> float:
    """The sum of squares that ``split_squares``' words (summed over every rank) stand for, in float64."""
    return float(high) * (2.0 ** -e) + float(low) * (2.0 ** -e_low)
