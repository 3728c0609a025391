"""BF16Optimizer: input validation (dtype, knobs, devices, duplicates) and the grid-wide grad norm.

Grid tests run a 2 dp x 2 tp grid of 4 gloo ranks built here with ``dist.new_group`` (no
parts.parallel: parts.optim needs only the groups and a ``replicated`` predicate). Grads are
multiples of 1/8 in [-1, 1] (exact in bf16), so the dp mean and every sum of squares are exact
in fp32; the only rounding is the fp32 sqrt of each piece's norm and its square (a few ulps):
norms are compared with rtol 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from harness import run
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from parts.optim import BF16Optimizer
from parts.optim.layout import GroupLayout, counted_ranges


def two_layers(second=torch.float32) -> nn.Module:
    """bf16 Linear, then a Linear in ``second``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4).to(torch.bfloat16), nn.Linear(4, 2).to(second))


def sgd(params, **kwargs) -> BF16Optimizer:
    return BF16Optimizer(torch.optim.SGD(params, lr=0.5), **kwargs)


# ------------------------------------------------------------------ dtype of the params
def test_fp32_params_raise_naming_the_first_offender() -> None:
    model = two_layers()
    with pytest.raises(TypeError, match=r"parameter '1\.weight' is torch\.float32.*allow_fp32=True"):
        sgd(model.parameters(), named_parameters=model.named_parameters())
    with pytest.raises(TypeError, match=r"'group0\.param2' is torch\.float32"):
        sgd(model.parameters())
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[1].parameters())}]
    with pytest.raises(ValueError, match=r"'group1\.param0' is torch\.float32"):  # also a ValueError
        sgd(groups)


def test_fp64_params_raise_even_with_allow_fp32() -> None:
    p = nn.Parameter(torch.ones(3, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"'w' is torch\.float64"):
        sgd([p], named_parameters=[("w", p)], allow_fp32=True)


def test_sharded_fp32_params_are_checked_too() -> None:
    from parts.partition import partition_module
    model = partition_module(nn.Linear(3, 4))  # a world of one: sharded, fp32
    with pytest.raises(TypeError, match=r"'weight' is torch\.float32"):
        sgd(model.parameters(), named_parameters=model.named_parameters())
    opt = sgd(model.parameters(), allow_fp32=True)
    assert len(opt.sharded_groups[0]) == 2


def test_allow_fp32_steps_fp32_params_exactly() -> None:
    """fp32 params opt in: SGD moves master and param by exactly lr * grad."""
    torch.manual_seed(1)
    model = nn.Linear(5, 3)
    opt = sgd(model.parameters(), allow_fp32=True, clip_grad=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 5)).pow(2).sum().backward()
    grads = [opt.full_grad(p) for p in model.parameters()]
    opt.step()
    for b, g, p in zip(before, grads, model.parameters()):
        assert torch.equal(p.detach(), b - 0.5 * g)
        assert torch.equal(opt.full_fp32_param(p), p.detach())


def test_bf16_and_fp16_params_are_accepted() -> None:
    for dtype in (torch.bfloat16, torch.float16):
        opt = sgd([nn.Parameter(torch.ones(3, dtype=dtype))])
        assert opt.flat_groups[0].flat.dtype == dtype


# ------------------------------------------------------------------ knobs, devices, duplicates
@pytest.mark.parametrize("bad", [torch.int32, torch.bool, torch.complex64, "float32"])
def test_grad_accum_dtype_must_be_floating(bad) -> None:
    with pytest.raises(ValueError, match=r"grad_accum_dtype must be a floating-point"):
        sgd([nn.Parameter(torch.ones(3, dtype=torch.bfloat16))], grad_accum_dtype=bad)


@pytest.mark.parametrize("size,exc", [(0, ValueError), (-4, ValueError), (1.5, TypeError),
                                      (True, ValueError)])
def test_allgather_bucket_size_must_be_positive(size, exc) -> None:
    with pytest.raises(exc, match="allgather_bucket_size"):
        sgd([nn.Parameter(torch.ones(3, dtype=torch.bfloat16))], allgather_bucket_size=size)


def test_two_devices_named() -> None:
    a = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    b = nn.Parameter(torch.ones(3, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match=r"'b' is torch\.bfloat16 on meta, 'a' is torch\.bfloat16 on cpu"):
        sgd([a, b], named_parameters={"a": a, "b": b})


def test_param_listed_twice_named_with_both_places() -> None:
    a = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    inner = torch.optim.SGD([{"params": [a]}, {"params": [nn.Parameter(torch.ones(2))]}], lr=0.1)
    inner.param_groups[1]["params"] = [a]  # bypasses torch's own check across groups
    with pytest.raises(ValueError, match=r"'group1\.param0' appears twice .*first as 'group0\.param0'"):
        BF16Optimizer(inner)


def test_frozen_param_named() -> None:
    model = two_layers(torch.bfloat16)
    model[1].bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"'1\.bias' does not require grad"):
        sgd(model.parameters(), named_parameters=model.named_parameters())


def test_replicated_needs_norm_groups_and_a_callable() -> None:
    p = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="replicated= needs norm_groups="):
        sgd([p], replicated=lambda q: True)
    with pytest.raises(TypeError, match="replicated must be a callable"):
        sgd([p], norm_groups=(None,), replicated=True)


def nonmember_norm_group_body():
    only0 = dist.new_group(ranks=[0])
    if dist.get_rank() == 0:
        return None
    try:
        sgd([nn.Parameter(torch.ones(3, dtype=torch.bfloat16))], norm_groups=(None, only0))
    except ValueError as err:
        return str(err)
    return "no error"


def test_norm_group_without_this_rank_raises_naming_it() -> None:
    out = run(2, nonmember_norm_group_body)
    assert out[0] is None and "norm_groups[1] does not contain this process (global rank 1)" in out[1]


def nonmember_group_body():
    only0 = dist.new_group(ranks=[0])
    if dist.get_rank() == 0:
        return None
    try:
        sgd([nn.Parameter(torch.ones(3, dtype=torch.bfloat16))], group=only0)
    except ValueError as err:
        return str(err)
    return "no error"


def test_group_without_this_rank_raises_naming_it_and_the_group() -> None:
    out = run(2, nonmember_group_body)
    assert out[0] is None
    assert "BF16Optimizer(group=...): rank 1 is not a member" in out[1], out[1]
    assert "(global ranks [0])" in out[1], out[1]


# ------------------------------------------------------------------ counted runs (pure)
@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 90), st.booleans()), min_size=1, max_size=8),
       st.integers(1, 4), st.data())
def test_counted_ranges_match_an_element_mask(spec, world, data) -> None:
    """The runs cover exactly the partition elements of counted params, sorted, merged, disjoint."""
    layout = GroupLayout(tuple(n for n, _ in spec), world)
    rank = data.draw(st.integers(0, world - 1))
    counted = [c for _, c in spec]
    runs = counted_ranges(layout.pieces(rank), counted)
    want = torch.zeros(layout.partition_numel, dtype=torch.bool)
    for pc in layout.pieces(rank):
        if counted[pc.index]:
            want[pc.offset:pc.offset + pc.stop - pc.start] = True
    got = torch.zeros_like(want)
    for (lo, n), nxt in zip(runs, runs[1:] + [(math.inf, 0)]):
        assert n > 0 and lo + n < nxt[0]  # merged: a gap separates consecutive runs
        got[lo:lo + n] = True
    assert torch.equal(got, want)


# ------------------------------------------------------------------ grid-wide norm
SPEC = [("a", 15, True), ("b", 7, False), ("c", 53, True), ("d", 3, False), ("e", 40, False)]
# name, numel, split over tp (each tp rank its own piece) or replicated (one copy per tp group)


def grid_groups():
    """(dp group, tp group, dp rank, tp rank) of a 2 dp x 2 tp grid; tp ranks are consecutive."""
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    d, t = divmod(dist.get_rank(), 2)
    return dp[t], tp[d], d, t


def grad_of(k: int, numel: int, split: bool, d: int, t: int) -> torch.Tensor:
    """Multiples of 1/8 in [-1, 1]: depends on dp rank, and on tp rank only for split params."""
    gen = torch.Generator().manual_seed(1000 * k + 10 * d + (t if split else 0))
    return torch.randint(-8, 9, (numel,), generator=gen).double() / 8


def expected(norm_type: float, count_replicated_everywhere: bool = False) -> tuple[float, dict]:
    """float64 grid norm and, per (param, tp rank), the dp-mean grad."""
    means, pieces = {}, []
    for t in range(2):
        for k, (name, n, split) in enumerate(SPEC):
            means[name, t] = (grad_of(k, n, split, 0, t) + grad_of(k, n, split, 1, t)) / 2
            if split or t == 0 or count_replicated_everywhere:
                pieces.append(means[name, t])
    flat = torch.cat(pieces)
    return float(torch.linalg.vector_norm(flat, norm_type)), means


def grid_body(norm_type: float, clip_ratio: float, mark_replicated: bool, poison: bool):
    dp, tp, d, t = grid_groups()
    params = {name: nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for name, n, _ in SPEC}
    for name, _, split in SPEC:
        params[name].split = split
    ref, means = expected(norm_type, count_replicated_everywhere=not mark_replicated)
    kw = dict(replicated=lambda p: not p.split) if mark_replicated else {}
    opt = BF16Optimizer(torch.optim.SGD(list(params.values()), lr=1.0), group=dp,
                        clip_grad=ref * clip_ratio, norm_type=norm_type, norm_groups=(tp,), **kw)
    loss = sum((p.float() * grad_of(k, p.numel(), p.split, d, t).float()).sum()
               for k, p in enumerate(params.values()))
    if poison and dist.get_rank() == 3:
        loss = loss + params["a"].float()[0] * math.inf  # one split param on one rank only
    loss.backward()
    opt.step()
    after = {name: opt.full_fp32_param(p).double() for name, p in params.items()}
    return opt.last_grad_norm, ref, opt.skipped_steps, after, means, t


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_grid_norm_counts_every_element_once_and_clips(norm_type: float) -> None:
    """All four ranks get the same norm over dp x tp with replicated params once, and the clip
    uses it: SGD(lr=1) moves each master by exactly -coef * (dp-mean grad), coef = max/(norm+1e-6)."""
    out = run(4, grid_body, norm_type, 0.25, True, False)
    norms = {o[0] for o in out}
    assert len(norms) == 1  # bitwise the same on every rank
    norm, ref = out[0][0], out[0][1]
    assert norm == pytest.approx(ref, rel=1e-6) and norm > 0
    coef = ref * 0.25 / (norm + 1e-6)
    for got_norm, _, skipped, after, means, t in out:
        assert skipped == 0
        for name, value in after.items():
            torch.testing.assert_close(value, -coef * means[name, t], rtol=1e-6, atol=1e-7)


def test_without_replicated_every_rank_counts_every_param() -> None:
    """norm_groups alone sums over the grid but counts replicated params once per tp rank:
    the documented meaning of leaving ``replicated`` out (and why the recipe passes it)."""
    out = run(4, grid_body, 2.0, 0.25, False, False)
    once, _ = expected(2.0)
    assert out[0][0] == pytest.approx(out[0][1], rel=1e-6) and out[0][0] > once * (1 + 1e-3)


def test_nonfinite_grad_on_one_tp_rank_skips_the_step_on_the_whole_grid() -> None:
    """Rank 3's inf is in a tp-split param its dp group alone would not see on ranks 0 and 2."""
    out = run(4, grid_body, 2.0, 0.25, True, True)
    for norm, _, skipped, after, _, _ in out:
        assert math.isinf(norm) and skipped == 1
        assert all(torch.equal(v, torch.zeros_like(v)) for v in after.values())


def test_add_param_group_after_construction_is_refused() -> None:
    model = two_layers(torch.bfloat16)
    opt = sgd(model[0].parameters())
    with pytest.raises(NotImplementedError, match=r"BF16Optimizer cannot add param groups after construction"):
        opt.add_param_group({"params": list(model[1].parameters())})
    assert len(opt.param_groups) == 1
