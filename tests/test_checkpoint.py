"""parts.checkpoint in one process: bitwise-equal grads, autograd.grad, nesting, policy options,
buffers and errors (RNG replay: test_checkpoint_rng.py; memory: test_checkpoint_memory.py).

The models below are also imported by test_checkpoint_dist.py (partition_group 1..4) and the
RNG and memory files.
Every comparison is torch.equal: checkpointing replays the same ops on the same values.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parts.checkpoint import (CheckpointPolicy, ContiguousBuffers, checkpoint,
                              seed_model_parallel)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny ops: one intra-op thread, as in the harness workers (OpenMP spin-waits on a busy
    2-core machine made this file 15x slower); restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# ------------------------------------------------------------------ models shared with dist tests


class MLP(nn.Module):
    def __init__(self, dim: int = 11, hidden: int = 24, p: float = 0.3) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.drop1, self.drop2 = nn.Dropout(p), nn.Dropout(p)

    def forward(self, x):
        return x + self.drop2(self.fc2(self.drop1(F.gelu(self.fc1(x)))))


class Block(nn.Module):
    """Pre-LN transformer block; ``mask`` is bool (True = masked) or additive float."""

    def __init__(self, dim: int = 7, heads: int = 1, p: float = 0.25) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.attn_drop, self.resid_drop = nn.Dropout(p), nn.Dropout(p)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        attn = self.attn_drop(scores.softmax(-1))
        y = torch.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, d)
        x = x + self.resid_drop(self.proj(y))
        return x + self.resid_drop(self.mlp(self.ln2(x)))


class IntOut(nn.Module):
    """Returns (float tensor, int64 tensor): the second output is not differentiable."""

    def __init__(self, dim: int = 3) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        y = torch.tanh(F.dropout(self.lin(x), 0.3, self.training))
        return y, (y > 0).long().sum(-1)


class NoneIntArgs(nn.Module):
    def __init__(self, dim: int = 5) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x, bias, repeats, scale=1.0, mode="relu", extra=(1, 2.5), gate=None):
        for _ in range(repeats):
            x = self.lin(x) * scale + (0.0 if bias is None else bias)
            x = F.relu(x) if mode == "relu" else torch.tanh(x)
            x = F.dropout(x, 0.2, self.training) * extra[1]
        return x if gate is None else x * gate


def _mlp_case(call):
    model = MLP()
    x = torch.randn(5, 11, requires_grad=True)          # 55 elements: uneven over 2, 3, 4
    h = x * 2
    for _ in range(3):
        h = call(model, h)
    return h.square().sum(), [x], model


def _block_case(call):
    model = Block()
    x = torch.randn(1, 5, 7, requires_grad=True)        # 35 elements
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    additive = torch.zeros(5, 5).masked_fill(causal, -1e9)
    h = x + 0
    for i in range(4):
        h = call(model, h, causal) if i % 2 else call(model, h, mask=additive)
    return h.square().sum(), [x], model


def _int_out_case(call):
    model = IntOut()
    x = torch.randn(1, 3, requires_grad=True)           # 3 elements: fewer than 4 ranks
    y, n = call(model, x * 1.5)
    assert n.dtype == torch.int64 and not n.requires_grad
    y2, n2 = call(model, y)
    return (y2 * (n + n2 + 1)).sum(), [x], model


def _none_int_case(call):
    model = NoneIntArgs()
    x = torch.randn(2, 5, requires_grad=True)
    gate = torch.rand(2, 5)                             # tensor argument not requiring grad
    h = call(model, x * 1.0, None, 2, scale=0.5, mode="tanh", extra=(3, 0.75))
    h = call(model, h, torch.ones(5), 1, gate=gate)
    return h.sum(), [x], model


CASES = {"mlp": _mlp_case, "block": _block_case, "int_out": _int_out_case,
         "none_int": _none_int_case}


def case_grads(name: str, policy=None, ckpt: bool = True, seed: int = 0,
               use_grad_api: bool = False) -> list[torch.Tensor]:
    """Grads of inputs and parameters of case ``name`` (same seed on every rank)."""
    def call(fn, *args, **kwargs):
        return checkpoint(fn, *args, policy=policy, **kwargs) if ckpt else fn(*args, **kwargs)

    loss, inputs, model = _build_and_run(CASES[name], call, seed)
    leaves = inputs + list(model.parameters())
    if use_grad_api:
        return list(torch.autograd.grad(loss, leaves))
    loss.backward()
    return [t.grad for t in leaves]


def _build_and_run(builder, call, seed):
    """Build the model and inputs from ``seed``, then run forward from a fixed dropout seed."""
    torch.manual_seed(seed)
    state = {}

    def seeded_call(fn, *args, **kwargs):
        if "seeded" not in state:
            torch.manual_seed(seed + 1000)  # dropout stream starts after the model is built
            state["seeded"] = True
        return call(fn, *args, **kwargs)

    return builder(seeded_call)


def assert_all_equal(a: list, b: list) -> None:
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert u is not None and v is not None, f"grad {i} missing"
        assert torch.equal(u, v), f"grad {i} differs: max abs diff {(u - v).abs().max()}"


# ------------------------------------------------------------------ bitwise equality

POLICIES = {
    "default": lambda: None,
    "cpu_offload": lambda: CheckpointPolicy(cpu_offload=True),
    "buffers": lambda: CheckpointPolicy(buffers=ContiguousBuffers(8)),
    "synchronize": lambda: CheckpointPolicy(synchronize=True),
    "profile": lambda: CheckpointPolicy(profile=True),
    "tracker": lambda: CheckpointPolicy(rng_tracker=seed_model_parallel(7)),
    "combined": lambda: CheckpointPolicy(cpu_offload=True, buffers=ContiguousBuffers(8),
                                         synchronize=True, profile=True,
                                         rng_tracker=seed_model_parallel(7)),
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_grads_bitwise_equal(case, policy):
    ref = case_grads(case, ckpt=False)
    got = case_grads(case, policy=POLICIES[policy]())
    assert_all_equal(ref, got)
    assert any(g.abs().sum() > 0 for g in got)


@pytest.mark.parametrize("case", sorted(CASES))
def test_autograd_grad_api(case):
    assert_all_equal(case_grads(case, ckpt=False), case_grads(case, use_grad_api=True))


def test_dropout_is_active_so_replay_matters():
    # another dropout draw gives other grads: the equalities above are not vacuous
    def grads(dropout_seed):
        torch.manual_seed(0)
        model, x = MLP(), torch.randn(5, 11, requires_grad=True)
        torch.manual_seed(dropout_seed)
        model(x * 2).square().sum().backward()
        return x.grad

    assert torch.equal(grads(5), grads(5))
    assert not torch.equal(grads(5), grads(6))


def test_grad_wrt_input_subset_only():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(5, 11, requires_grad=True)
    torch.manual_seed(3)
    (ref,) = torch.autograd.grad(model(model(x * 1.0)).sum(), [x])
    torch.manual_seed(3)
    out = checkpoint(model, checkpoint(model, x * 1.0))
    (got,) = torch.autograd.grad(out.sum(), [x])
    assert torch.equal(ref, got)
    assert all(p.grad is None for p in model.parameters())


def _nested(model, inner_policy, outer_policy, ckpt):
    def two_blocks(h):
        for layer in model:
            h = checkpoint(layer, h, policy=inner_policy) if ckpt else layer(h)
        return h

    torch.manual_seed(0)
    x = torch.randn(5, 11, requires_grad=True)
    torch.manual_seed(9)
    h = x * 1.0
    for _ in range(2):
        h = checkpoint(two_blocks, h, policy=outer_policy) if ckpt else two_blocks(h)
    h.pow(3).sum().backward()
    return [x.grad] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("inner", ["default", "buffers", "combined"])
def test_nested_checkpoints(inner):
    torch.manual_seed(0)
    model = nn.Sequential(MLP(), MLP())
    ref = _nested(model, None, None, ckpt=False)
    model.zero_grad(set_to_none=True)
    got = _nested(model, POLICIES[inner](), CheckpointPolicy(buffers=ContiguousBuffers(2)),
                  ckpt=True)
    assert_all_equal(ref, got)


def test_retain_graph_backward_twice():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(5, 11, requires_grad=True)
    torch.manual_seed(4)
    loss = model(model(x * 1.0)).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    ref = x.grad.clone()
    x.grad = None
    torch.manual_seed(4)
    loss = checkpoint(model, checkpoint(model, x * 1.0)).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert torch.equal(ref, x.grad)


# ------------------------------------------------------------------ policy options


def test_profile_counts_calls():
    policy = CheckpointPolicy(profile=True)
    case_grads("mlp", policy=policy)
    timers = policy.timers
    assert timers("checkpoint.forward").count == 3
    assert timers("checkpoint.recompute").count == 3
    assert timers("checkpoint.restore").count == 3
    assert timers("checkpoint.recompute").elapsed() > 0.0


def test_buffers_reused_each_step_and_exhaustion():
    buffers = ContiguousBuffers(3)
    policy = CheckpointPolicy(buffers=buffers)
    for _ in range(3):
        buffers.reset()
        case_grads("mlp", policy=policy)
    assert buffers.allocations == 3 and buffers.used == 3
    assert buffers.nbytes() == 3 * 256  # 55 floats = 220 bytes, aligned to 64
    with pytest.raises(RuntimeError, match=r"ContiguousBuffers\(num_layers=3\) exhausted.*call 4"):
        case_grads("mlp", policy=policy)


def test_buffers_reset_before_backward_raises():
    buffers = ContiguousBuffers(1)
    torch.manual_seed(0)
    model = MLP()
    out = checkpoint(model, torch.randn(5, 11) * 1.0, policy=CheckpointPolicy(buffers=buffers))
    buffers.reset()
    with pytest.raises(RuntimeError, match="layer 0 was reset"):
        out.sum().backward()


def test_policy_validation():
    with pytest.raises(TypeError, match="cpu_offload must be a bool"):
        CheckpointPolicy(cpu_offload=1)
    with pytest.raises(TypeError, match="buffers must be ContiguousBuffers"):
        CheckpointPolicy(buffers=3)
    with pytest.raises(TypeError, match="rng_tracker must be an RNGTracker"):
        CheckpointPolicy(rng_tracker="x")
    with pytest.raises(ValueError, match="check_replicated needs a partition_group"):
        CheckpointPolicy(check_replicated=True)
    with pytest.raises(ValueError, match="num_layers must be an int >= 1"):
        ContiguousBuffers(0)
    with pytest.raises(TypeError, match="policy must be a CheckpointPolicy"):
        checkpoint(torch.relu, torch.ones(1), policy={"cpu_offload": True})
    with pytest.raises(TypeError, match="function must be callable"):
        checkpoint(3, torch.ones(1))
    policy = CheckpointPolicy()
    with pytest.raises(AttributeError):
        policy.cpu_offload = True


# ------------------------------------------------------------------ errors and modes


def test_in_place_change_of_input_raises():
    lin = nn.Linear(4, 4)
    h = torch.randn(2, 4, requires_grad=True) * 1.0
    out = checkpoint(lin, h)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match=r"input args\[0\] was modified in place"):
        out.sum().backward()


def test_create_graph_raises():
    lin = nn.Linear(4, 4)
    out = checkpoint(lambda t: torch.tanh(lin(t)), torch.randn(2, 4, requires_grad=True))
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(out.sum(), list(lin.parameters()), create_graph=True)


def test_different_path_in_recompute_raises():
    calls = []

    def flaky(t):
        calls.append(1)
        return t.exp() if len(calls) == 1 else t.exp().exp()

    out = checkpoint(flaky, torch.randn(3, requires_grad=True))
    with pytest.raises(RuntimeError, match="saved 1 tensors in forward but 2 when recomputed"):
        out.sum().backward()


def test_no_grad_runs_function_directly():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(5, 11)
    model.eval()
    with torch.no_grad():
        assert torch.equal(checkpoint(model, x), model(x))


def test_kwargs_nested_tuple_and_dict_arguments():
    lin = nn.Linear(3, 3)

    def fn(pair, table, *, weight):
        return lin(pair[0]) * table["s"] + pair[1] * weight

    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    ref = torch.autograd.grad(fn((a * 1, b * 1), {"s": 2.0}, weight=w).sum(), [a, b, w])
    got = torch.autograd.grad(checkpoint(fn, (a * 1, b * 1), {"s": 2.0}, weight=w,
                                         policy=CheckpointPolicy(buffers=ContiguousBuffers(1))).sum(),
                              [a, b, w])
    assert_all_equal(list(ref), list(got))
