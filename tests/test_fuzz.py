"""Fuzz: random module trees under ``partitioned`` + ``attach`` equal the unsharded reference.

A hypothesis strategy draws a tree of modules: a width, nested sequences (depth 1..3, 1..3
children), leaves that are linear layers (with or without bias), elementwise scales with a
buffer, LayerNorms, a layer whose weight *is* an earlier linear's weight (a tied parameter
shared across branches), and a layer that reads an earlier linear's weight inside its own
forward (a parameter used by a sibling; declared with ``register_external_parameter`` or
left for the coordinator to notice). Any child may be skipped in any step (the same choice
on every rank), so traces are recorded, replayed and missed.

Equality: each rank feeds its own batch. The sharded forward must equal the plain model's
forward on that batch bitwise, and after the steps every grad shard must equal this rank's
slice of sum_steps (g_rank0 + g_rank1) / 2 bitwise: the reference grads come from the same
ops in the same order, the two-rank sum is commutative and the divide by 2 is exact.

The same trees in bf16 through ``BF16Optimizer`` are saved at world 2 and loaded at world 3:
fp32 masters and every AdamW state of every parameter must come back bitwise.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from harness import run
from hypothesis import HealthCheck, example, given, settings, strategies as st
from torch import nn

from parts.partition import (ParamStatus, attach, meta, partitioned, register_external_parameter)

STEPS = 2
BATCH = 3


# ------------------------------------------------------------------------------- modules
class Lin(nn.Module):
    """tanh(x W^T + b)."""

    def __init__(self, width: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width ** 0.5)
        self.bias = nn.Parameter(torch.randn(width) * 0.1) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight.t()
        return torch.tanh(y + self.bias if self.bias is not None else y)


class Scale(nn.Module):
    """x * weight + shift (a buffer)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(width))
        self.register_buffer("shift", 0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.shift.to(x.dtype)


class Tied(nn.Module):
    """tanh(x W) with W the very Parameter of an earlier ``Lin`` (a tie across branches)."""

    def __init__(self, other: Lin) -> None:
        super().__init__()
        self.weight = other.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight)


class Borrow(nn.Module):
    """tanh(x W_other^T) * gain: reads a sibling's weight inside its own forward."""

    def __init__(self, other: Lin, width: int) -> None:
        super().__init__()
        self.__dict__["other"] = other  # a reference, not a child
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.other.weight.t()) * self.gain


class Seq(nn.Module):
    """Children in order; child i is skipped in step s if ``skips[i][s]``."""

    def __init__(self, children: list, skips: list) -> None:
        super().__init__()
        self.kids = nn.ModuleList(children)
        self.skips = skips
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for kid, skip in zip(self.kids, self.skips):
            if not skip[self.step]:
                x = kid(x)
        return x


def build(spec: tuple, width: int) -> tuple[nn.Module, list]:
    """The module tree of ``spec`` and its (Borrow module, lender) pairs to register."""
    made: dict[int, nn.Module] = {}
    borrows: list = []

    def make(node: tuple) -> nn.Module:
        kind, nid = node[0], node[1]
        if kind == "seq":
            module = Seq([make(child) for child, _ in node[2]], [list(s) for _, s in node[2]])
        elif kind == "lin":
            module = Lin(width, node[2])
        elif kind == "scale":
            module = Scale(width)
        elif kind == "norm":
            module = nn.LayerNorm(width)
        elif kind == "tied":
            module = Tied(made[node[2]])
        else:
            module = Borrow(made[node[2]], width)
            if node[3]:
                borrows.append((module, made[node[2]]))
        made[nid] = module
        return module

    return make(spec), borrows


@st.composite
def trees(draw, min_width: int = 2) -> tuple:
    """(spec, width): a random tree of the modules above."""
    width = draw(st.integers(min_width, 9))
    ids = itertools.count()
    linears: list[int] = []
    max_depth = draw(st.integers(1, 3))

    def node(depth: int) -> tuple:
        nid = next(ids)
        if depth < max_depth and (depth == 0 or draw(st.booleans())):
            n = draw(st.integers(1, 3))
            kids = [(node(depth + 1), tuple(draw(st.lists(st.sampled_from([False] * 3 + [True]),
                                                           min_size=STEPS, max_size=STEPS))))
                    for _ in range(n)]
            return ("seq", nid, kids)
        kinds = ["lin", "scale", "norm"] + (["tied", "borrow"] if linears else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "lin":
            linears.append(nid)
            return ("lin", nid, draw(st.booleans()))
        if kind == "tied":
            return ("tied", nid, draw(st.sampled_from(linears)))
        if kind == "borrow":
            return ("borrow", nid, draw(st.sampled_from(linears)), draw(st.booleans()))
        return (kind, nid)

    root = node(0)
    if root[0] != "seq":
        root = ("seq", next(ids), [(root, (False,) * STEPS)])
    head = (("lin", next(ids), True), (False,) * STEPS)  # never skipped: the output needs a grad
    return ("seq", root[1], root[2] + [head]), width


def _set_step(model: nn.Module, step: int) -> None:
    for module in model.modules():
        if isinstance(module, Seq):
            module.step = step


def _batch(step: int, rank: int, width: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, width, generator=gen).to(dtype)


# ------------------------------------------------------------------ forward and grads
def _reference(spec: tuple, width: int, world: int) -> tuple[list, dict]:
    """Plain model: per-step outputs for every rank's batch, and sum_steps mean_ranks grads."""
    torch.manual_seed(7)
    model, _ = build(spec, width)
    params = dict(model.named_parameters())
    outs, total = [], {}
    for step in range(STEPS):
        _set_step(model, step)
        grads = []
        outs.append([])
        for rank in range(world):
            out = model(_batch(step, rank, width))
            outs[-1].append(out.detach())
            used = {n: p for n, p in params.items()}
            g = torch.autograd.grad(out.sum(), list(used.values()), allow_unused=True)
            grads.append(dict(zip(used, g)))
        for name in params:
            parts = [g[name] for g in grads]
            if parts[0] is None:
                continue
            mean = parts[0] + parts[1] if world == 2 else sum(parts)
            mean = mean / world
            total[name] = mean if name not in total else total[name] + mean
    return outs, total


def body_forward_backward(spec: tuple, width: int, knobs: dict) -> int:
    """Sharded run; asserts equality with the reference here (on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_outs, ref_grads = _reference(spec, width, world)
    torch.manual_seed(7)
    with partitioned():
        model, borrows = build(spec, width)
    coordinator = attach(model, **knobs)
    threshold = knobs["persistence_threshold"]  # model_persistence_threshold unset: all that fit
    for module, lender in borrows:
        register_external_parameter(module, lender.weight)
    for step in range(STEPS):
        _set_step(model, step)
        out = model(_batch(step, rank, width))
        assert torch.equal(out, ref_outs[step][rank]), f"step {step}: forward differs"
        out.sum().backward()
        for name, p in model.named_parameters():  # only persistent params stay gathered
            expect = ParamStatus.AVAILABLE if meta(p).numel <= threshold else ParamStatus.NOT_AVAILABLE
            assert meta(p).status is expect, f"step {step}: {name} is {meta(p).status.value}"
    checked = 0
    for name, p in model.named_parameters():
        m = meta(p)
        start, stop = m.layout.range(rank)
        if name not in ref_grads:
            assert m.grad_shard is None, f"{name}: a grad shard for a parameter never used"
            continue
        expect = ref_grads[name].reshape(-1)[start:stop]
        got = m.grad_shard
        assert torch.equal(got[:stop - start], expect), f"{name}: grad shard differs"
        assert not got[stop - start:].any(), f"{name}: padding of the grad shard is not zero"
        checked += 1
    coordinator.detach()
    return checked


# every feature at once: two branches, a tie across them, a registered and an unregistered
# borrower, a buffer, a LayerNorm, a child skipped in step 1 only, an odd width
ALL_FEATURES = (("seq", 0, [
    (("seq", 1, [(("lin", 2, True), (False, False)), (("scale", 3), (False, True))]), (False, False)),
    (("seq", 4, [(("tied", 5, 2), (False, False)), (("borrow", 6, 2, True), (False, False)),
                 (("norm", 7), (False, False)), (("borrow", 8, 2, False), (True, False))]),
     (False, False)),
    (("lin", 9, True), (False, False))]), 5)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=trees(), persistent=st.booleans(), reuse=st.booleans())
@example(tree=ALL_FEATURES, persistent=False, reuse=False)
@example(tree=ALL_FEATURES, persistent=True, reuse=True)
def test_random_trees_equal_the_unsharded_reference(tree, persistent, reuse) -> None:
    spec, width = tree
    knobs = dict(persistence_threshold=width if persistent else 0,
                 max_reuse_distance=10 ** 9 if reuse else 0)
    checked = run(2, body_forward_backward, spec, width, knobs, timeout=60)
    assert checked[0] == checked[1]


# ------------------------------------------------------------ BF16Optimizer world 2 -> 3
KEYS = ("exp_avg", "exp_avg_sq", "step")


def _sharded_bf16(spec: tuple, width: int):
    """The tree sharded in bf16, attached, with BF16Optimizer(AdamW) over it."""
    from parts.optim import BF16Optimizer
    torch.manual_seed(7)
    with partitioned(dtype=torch.bfloat16):
        model, borrows = build(spec, width)
    attach(model, persistence_threshold=0)
    for module, lender in borrows:
        register_external_parameter(module, lender.weight)
    named = list(model.named_parameters())
    optimizer = BF16Optimizer(torch.optim.AdamW([p for _, p in named], lr=1e-2),
                              named_parameters=named)
    return model, optimizer


def _snapshot(model: nn.Module, optimizer) -> dict:
    """Full fp32 masters and AdamW states of every parameter (collectives, on every rank)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = optimizer.full_fp32_param(p)
        for key in KEYS:
            try:
                out[f"{name}/{key}"] = optimizer.full_state(p, key)
            except KeyError:  # never had a grad (skipped in every step): no state yet
                out[f"{name}/{key}"] = None
    return out


def body_bf16_save(spec: tuple, width: int):
    rank = dist.get_rank()
    model, optimizer = _sharded_bf16(spec, width)
    for step in range(STEPS):
        _set_step(model, step)
        model(_batch(step, rank, width, torch.bfloat16)).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer.state_dict(), _snapshot(model, optimizer)


def body_bf16_load(spec: tuple, width: int, saved: list):
    model, optimizer = _sharded_bf16(spec, width)
    optimizer.load_state_dict(saved)
    return _snapshot(model, optimizer)


def _round_trip_2_to_3(spec: tuple, width: int) -> None:
    saved = run(2, body_bf16_save, spec, width, timeout=60)
    before = saved[0][1]
    assert all(s[1].keys() == before.keys() for s in saved)
    for snap in run(3, body_bf16_load, spec, width, [s[0] for s in saved], timeout=60):
        assert snap.keys() == before.keys()
        for key, value in before.items():
            if value is None:
                assert snap[key] is None, key
            else:
                assert torch.equal(snap[key], value), key


# Widths from 2: a parameter of 1, 2 or 4 elements leaves rank 2 of 3 without elements of it
# (the test below pins the smallest such case explicitly).
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=trees())
@example(tree=ALL_FEATURES)
def test_random_trees_bf16_optimizer_state_round_trips_2_to_3(tree) -> None:
    _round_trip_2_to_3(*tree)


def test_bf16_optimizer_loads_a_parameter_smaller_than_the_world() -> None:
    spec = ("seq", 0, [(("scale", 1), (False, False)), (("lin", 2, True), (False, False))])
    _round_trip_2_to_3(spec, 2)
