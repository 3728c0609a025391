"""Blockwise symmetric quantization (int8; int4 two per byte) and error feedback: pure arithmetic.

A tensor of ``rows x n`` elements is cut, row by row, into blocks of ``block`` elements (the
last block of a row may be shorter): a block never straddles two rows, so quantizing each
rank's chunk as a row gives the same bytes whether the chunks are quantized apart or together
(quantize-then-gather is gather-then-quantize). Each block keeps one fp32 scale, its largest
magnitude ``a``; an element ``x`` is sent as the integer ``q = round(x / a * Q)`` (``Q`` = 127
for int8, 7 for int4) and read back as ``(q / Q) * a``. So zeros, constant blocks and each
block's largest magnitude come back exactly (``q / Q`` is exactly +-1 there), and every
element is within half a step (``a / Q / 2``) of what was sent, plus fp32 rounding of the
scale arithmetic: at most ``a / Q * 2**-14`` more (and ``2**-149`` in subnormal blocks).

Non-finite input is propagated, never silenced: a block holding a NaN or an infinity gets a
NaN scale, so every element of that block reads back as NaN (a loss scaler's overflow check
or a grad-norm check sees it); no finite wrong value is ever produced from it.

int4 codes are stored as ``q + 8`` (1..15), two per byte, the even element in the low
nibble; an odd row ends with a zero code (8).

``ErrorFeedback`` keeps, per key (one per parameter and hop), the residual of what could not
be sent: ``send = quantize(g + residual)``, ``residual = (g + residual) - dequantize(send)``,
so over steps the sum of what was sent equals the sum of the true values minus the last
residual (in exact arithmetic; fp32 adds one rounding of ``g + residual`` and one of the
subtraction per step). A residual that is not finite (a NaN block) restarts at zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Optional

import torch

QMAX = {8: 127, 4: 7}
"""The largest code of each width (symmetric: codes run from -QMAX to QMAX)."""

BITS = {"int8": 8, "int4": 4}


def num_blocks(numel: int, block: int) -> int:
    """Blocks of at most ``block`` elements in a row of ``numel`` (the last may be shorter)."""
    return -(-numel // block)


def code_bytes(numel: int, bits: int) -> int:
    """Bytes of the codes of one row of ``numel`` elements."""
    return numel if bits == 8 else (numel + 1) // 2


@dataclass(frozen=True)
class Quantized:
    """The codes and scales of ``rows x numel`` elements: ``codes`` (rows, code_bytes) int8 for
    int8 or packed uint8 for int4, ``scales`` (rows, blocks) fp32 (each block's largest magnitude)."""

    codes: torch.Tensor
    scales: torch.Tensor
    numel: int
    block: int
    bits: int


def _check(block: int, bits: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"quantize: bits must be 8 or 4, got {bits!r}")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"quantize: block must be a positive int, got {block!r}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as fp32 rows: a 1-D tensor is one row, more dimensions are (leading, last)."""
    x = x.reshape(1, -1) if x.dim() <= 1 else x.flatten(0, -2)
    return x if x.dtype == torch.float32 else x.float()


def _per_block(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the full blocks of each row as (rows, k, block) and of the tail as (rows, 1, n - k * block)
    (a view whenever each row is contiguous: splitting a contiguous dimension needs no copy)."""
    rows, n = x.shape
    full = n // block * block
    return x[:, :full].view(rows, full // block, block), x[:, full:].view(rows, 1 if n > full else 0, n - full)


def _absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each block's largest magnitude, NaN for a block holding a NaN or an infinity."""
    main, tail = _per_block(x, block)
    # max(max, -min): two reductions that allocate nothing (|x| would be a full-size copy); both propagate NaN
    parts = [torch.maximum(t.amax(2), t.amin(2).neg()) for t in (main, tail) if t.shape[1] and t.shape[2]]
    amax = torch.cat(parts, 1) if parts else x.new_zeros(x.shape[0], 0)
    return torch.where(torch.isfinite(amax), amax, torch.full_like(amax, float("nan")))


def _by_block(x: torch.Tensor, scales: torch.Tensor, block: int, op: Callable,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``op(values, scale)`` over each block of the (rows, n) ``x`` with its scale broadcast, written
    into ``out`` (rows, n; fp32 if not given, else cast as it is stored)."""
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=torch.float32, device=x.device) if out is None else out
    (main, tail), (main_out, tail_out) = _per_block(x, block), _per_block(out, block)
    k = main.shape[1]
    op(main, scales[:, :k, None], out=main_out)
    if tail.shape[1] and tail.shape[2]:
        op(tail, scales[:, k:, None], out=tail_out)
    return out


def quantize(x: torch.Tensor, block: int, bits: int = 8) -> Quantized:
    """``x`` (1-D: one row; else rows along the last dimension) as blockwise codes and fp32
    scales; blocks restart at every row. See the module docstring for the guarantees."""
    _check(block, bits)
    x = _rows(x).contiguous()
    n = x.shape[1]
    scales = _absmax(x, block)
    # |x| <= its block's scale, so |x / scale| <= 1 and the codes stay within +-QMAX; a zero
    # block divides by 1 (codes 0), a non-finite one by infinity (codes 0 or NaN, then 0)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    safe = torch.where(scales.isnan(), torch.full_like(scales, float("inf")), safe)
    codes = _by_block(x, safe, block, torch.div).mul_(QMAX[bits]).round_().nan_to_num_(0.0)
    if bits == 8:
        return Quantized(codes.to(torch.int8), scales, n, block, bits)
    return Quantized(_pack4(codes), scales, n, block, bits)


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    """Codes -7..7 as ``q + 8`` two per byte, the even element in the low nibble."""
    u = (codes + 8).to(torch.uint8)
    if u.shape[1] % 2:
        u = torch.cat([u, u.new_full((u.shape[0], 1), 8)], 1)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def _unpack4(packed: torch.Tensor, n: int) -> torch.Tensor:
    both = torch.stack([packed & 15, packed >> 4], dim=2).reshape(packed.shape[0], -1)
    return both[:, :n].to(torch.float32) - 8


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The values ``q`` stands for, (rows, numel), in ``dtype`` (computed in fp32, then cast), or
    written into ``out`` (a (rows, numel) tensor whose rows are contiguous, of any float dtype)."""
    ratios = torch.div(q.codes, QMAX[q.bits]) if q.bits == 8 else _unpack4(q.codes, q.numel).div_(QMAX[q.bits])
    if out is None and dtype != torch.float32:
        out = torch.empty(q.scales.shape[0], q.numel, dtype=dtype, device=q.scales.device)
    return _by_block(ratios, q.scales, q.block, torch.mul, out)


def step_size(q: Quantized) -> torch.Tensor:
    """Each element's quantization step (its block's scale / QMAX), (rows, numel)."""
    ones = torch.ones(q.scales.shape[0], q.numel, device=q.scales.device)
    return _by_block(ones, q.scales / QMAX[q.bits], q.block, torch.mul)


class ErrorFeedback:
    """Residuals of what could not be sent, one fp32 tensor per key (e.g. parameter and hop):
    ``compensate`` quantizes the value plus its residual and keeps the new residual."""

    def __init__(self) -> None:
        self._residuals: dict[Hashable, torch.Tensor] = {}

    def compensate(self, key: Hashable, x: torch.Tensor, block: int, bits: int,
                   exact_row: Optional[int] = None) -> tuple[Quantized, torch.Tensor]:
        """``(quantize(x + residual), x + residual)`` as fp32 rows; the residual becomes what the
        codes miss. ``exact_row``: a row not sent (this rank's own chunk), used exactly: residual 0."""
        t = _rows(x).clone() if x.dtype == torch.float32 else _rows(x)
        kept = self._residuals.get(key)
        if kept is not None and kept.shape == t.shape:
            t.add_(kept)
        q = quantize(t, block, bits)
        residual = t - dequantize(q)
        residual.nan_to_num_(0.0, 0.0, 0.0)  # a non-finite block (sent as NaN) restarts at zero
        if exact_row is not None:
            residual[exact_row].zero_()
        self._residuals[key] = residual
        return q, t

    def residual(self, key: Hashable) -> Optional[torch.Tensor]:
        """The residual kept under ``key`` (None before its first ``compensate``)."""
        return self._residuals.get(key)

    def nbytes(self) -> int:
        """Bytes the residuals hold (the memory cost of error feedback)."""
        return sum(r.numel() * r.element_size() for r in self._residuals.values())

    def clear(self) -> None:
        """Forget every residual."""
        self._residuals.clear()
