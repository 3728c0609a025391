"""The block quantizer, its wire format and error feedback (parts.comm.quantize, parts.comm.compressed):
pure functions, property-tested on any shape, block size and uneven tail."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parts.comm.compressed import Codec, from_wire, row_bytes, to_wire
from parts.comm.quantize import ErrorFeedback, dequantize, quantize, step_size

TINY = 2.0 ** -149  # the smallest subnormal: the rounding of a product in a subnormal block
FP32_SLACK = 2.0 ** -14  # the scale arithmetic's fp32 rounding, relative to half a step

finite = st.floats(-2.0 ** 100, 2.0 ** 100, width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)
magnitudes = st.sampled_from([1e-40, 1e-20, 1e-3, 1.0, 1e4, 1e30])
specials = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.0 ** -149, 3e38, -3e38, 1e-30])


@st.composite
def matrices(draw, max_rows: int = 4, max_cols: int = 130) -> torch.Tensor:
    """A (rows, n) fp32 tensor: normal or heavy-tailed values at one of several magnitudes
    (subnormal to 1e30), with a few elements set to zeros, extremes or repeats."""
    rows, n = draw(st.integers(1, max_rows)), draw(st.integers(0, max_cols))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    x = torch.randn(rows, n, generator=g)
    if draw(st.booleans()):
        x = x.pow(5)
    x = (x.double() * draw(magnitudes)).float()
    if rows * n:
        for index, value in draw(st.lists(st.tuples(st.integers(0, rows * n - 1), st.one_of(specials, finite)),
                                          max_size=6)):
            x.view(-1)[index] = value
    return x


common = settings(deadline=None, max_examples=60)


@common
@given(matrices(), st.integers(1, 70), st.sampled_from([8, 4]))
def test_every_element_is_within_half_a_step_of_its_block_scale(x, block, bits):
    q = quantize(x, block, bits)
    error = (dequantize(q) - x).abs()
    bound = step_size(q) / 2 * (1 + FP32_SLACK) + TINY
    assert (error <= bound).all(), (error - bound).max()


@common
@given(matrices(), st.integers(1, 70), st.sampled_from([8, 4]))
def test_zeros_and_each_blocks_largest_magnitude_come_back_exactly(x, block, bits):
    back = dequantize(quantize(x, block, bits))
    assert torch.equal(back[x == 0], x[x == 0])
    rows, n = x.shape
    for start in range(0, n, block):
        piece, got = x[:, start:start + block], back[:, start:start + block]
        top = piece.abs().argmax(dim=1, keepdim=True)
        assert torch.equal(got.gather(1, top), piece.gather(1, top))


@common
@given(st.integers(1, 3), st.integers(1, 90), st.integers(1, 40), finite, st.sampled_from([8, 4]))
def test_constant_blocks_come_back_exactly(rows, n, block, value, bits):
    x = torch.full((rows, n), value, dtype=torch.float32)
    assert torch.equal(dequantize(quantize(x, block, bits)), x)


@common
@given(matrices(), st.integers(1, 70), st.sampled_from([8, 4]))
def test_blocks_restart_at_every_row_so_rows_quantized_apart_give_the_same_bytes(x, block, bits):
    together = quantize(x, block, bits)
    for r in range(x.shape[0]):
        alone = quantize(x[r], block, bits)
        assert torch.equal(together.codes[r], alone.codes[0])
        assert torch.equal(together.scales[r], alone.scales[0])
    assert torch.equal(dequantize(together)[0], dequantize(quantize(x[0], block, bits))[0])


@common
@given(matrices(max_rows=3), st.integers(1, 30), st.sampled_from([8, 4]), st.data())
def test_a_nan_or_infinity_makes_its_whole_block_nan_and_leaves_the_others_alone(x, block, bits, data):
    if x.shape[1] == 0:
        return
    r, c = data.draw(st.integers(0, x.shape[0] - 1)), data.draw(st.integers(0, x.shape[1] - 1))
    bad = x.clone()
    bad[r, c] = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    back, clean = dequantize(quantize(bad, block, bits)), dequantize(quantize(x, block, bits))
    start = c // block * block
    assert back[r, start:start + block].isnan().all()
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[r, start:start + block] = False
    assert torch.equal(back[mask], clean[mask])


@common
@given(st.lists(matrices(max_rows=2, max_cols=40), min_size=1, max_size=4), st.integers(1, 20),
       st.sampled_from([8, 4]))
def test_the_wire_carries_codes_and_scales_unchanged(pieces, block, bits):
    rows = pieces[0].shape[0]
    pieces = [p[:rows] if p.shape[0] >= rows else p.repeat(rows, 1)[:rows] for p in pieces]
    qs = [quantize(p, block, bits) for p in pieces]
    wire = to_wire(qs)
    codec = Codec(bits, block)
    assert wire.dtype == torch.uint8 and wire.shape == (rows, row_bytes([p.shape[1] for p in pieces], codec))
    for q, back in zip(qs, from_wire(wire, [p.shape[1] for p in pieces], codec)):
        assert torch.equal(dequantize(q), dequantize(back))


def test_int8_wire_is_a_quarter_of_fp32_plus_one_scale_per_block():
    n = 1 << 16
    assert row_bytes([n], Codec(8, 256)) / (4 * n) == pytest.approx(0.25 + 1 / 256)
    assert row_bytes([n], Codec(4, 256)) / (4 * n) == pytest.approx(0.125 + 1 / 256)


@common
@given(st.integers(1, 8), st.integers(1, 3), st.integers(1, 60), st.integers(1, 25), st.sampled_from([8, 4]),
       st.integers(0, 2 ** 31 - 1))
def test_error_feedback_sends_the_sum_of_the_true_values_up_to_the_last_residual(steps, rows, n, block, bits, seed):
    """sum(sent) + last residual == sum(true) up to fp32 rounding of ``g + residual`` and of the
    new residual: 2**-24 of each per step, bounded here by 2**-22 (|sent| + |residual|) per step."""
    g = torch.Generator().manual_seed(seed)
    ef = ErrorFeedback()
    total_true = torch.zeros(rows, n, dtype=torch.float64)
    total_sent = torch.zeros(rows, n, dtype=torch.float64)
    slack = torch.zeros(rows, n, dtype=torch.float64)
    for _ in range(steps):
        value = torch.randn(rows, n, generator=g) * 10.0 ** torch.randint(-3, 4, (1,), generator=g).item()
        q, _ = ef.compensate("p", value, block, bits)
        sent = dequantize(q).double()
        total_true += value.double()
        total_sent += sent
        slack += (sent.abs() + ef.residual("p").double().abs()) * 2.0 ** -22
    gap = (total_sent + ef.residual("p").double() - total_true).abs()
    assert (gap <= slack + steps * TINY).all(), (gap - slack).max()


def test_error_feedback_keeps_an_exact_row_out_and_restarts_a_nan_residual():
    ef = ErrorFeedback()
    x = torch.randn(3, 50)
    q, t = ef.compensate("k", x, 16, 8, exact_row=1)
    assert torch.equal(t, x) and torch.equal(ef.residual("k")[1], torch.zeros(50))
    assert ef.nbytes() == 3 * 50 * 4
    x[0, 3] = float("nan")
    ef.compensate("k", x, 16, 8)
    assert ef.residual("k").isfinite().all()


@pytest.mark.parametrize("bad", [dict(block=0), dict(block=2.5), dict(bits=3)])
def test_bad_block_or_width_is_refused(bad):
    args = dict(block=4, bits=8) | bad
    with pytest.raises(ValueError, match="block|bits"):
        quantize(torch.ones(4), **args)


def test_codes_are_int8_or_two_per_byte():
    x = torch.randn(2, 9)
    assert quantize(x, 4, 8).codes.dtype == torch.int8 and quantize(x, 4, 8).codes.shape == (2, 9)
    packed = quantize(x, 4, 4).codes
    assert packed.dtype == torch.uint8 and packed.shape == (2, math.ceil(9 / 2))
