"""float64 models train sharded in float64: grad shards take the parameter's dtype."""

import copy
from typing import Optional

import pytest
import torch
from torch import nn

from harness import run
from parts.partition import clip_grad_norm_, meta, partition_module, shards
from parts.partition.coordinator import attach
from parts.partition.core.grads import grad_dtype
from test_coordinator_models import full_params, rank_info

ROWS = 6  # per rank


class Uneven(nn.Module):
    """Weights of uneven shapes: 7x5, 1xN, Nx1 and 2xN (fewer rows than ranks at world 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.row = nn.Parameter(torch.randn(1, 7))
        self.col = nn.Parameter(torch.randn(7, 1))
        self.few = nn.Linear(7, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * self.row
        return (self.few(h).sum(-1, keepdim=True) + h @ self.col).square().mean()


def _batch(step: int, rows: int, offset: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(64, 5, generator=g, dtype=dtype)[offset:offset + rows]


def _opt(kind: str, params) -> torch.optim.Optimizer:
    return (torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1) if kind == "adamw"
            else torch.optim.SGD(params, lr=5e-2, momentum=0.9))


def _train(model, opt, steps: int, rows: int, offset: int, dtype: torch.dtype, clip=None) -> None:
    for step in range(steps):
        model(_batch(step, rows, offset, dtype)).backward()
        if clip is not None:
            clip(model)
        opt.step()
        opt.zero_grad()


def _float64_case(kind: str, knobs: dict, max_norm: Optional[float] = None) -> tuple:
    rank, world = rank_info()
    torch.manual_seed(0)
    ref = Uneven().double()
    model = partition_module(copy.deepcopy(ref))
    attach(model, **knobs)
    clips = ((lambda m: nn.utils.clip_grad_norm_(m.parameters(), max_norm)),
             (lambda m: clip_grad_norm_(m, max_norm))) if max_norm else (None, None)
    _train(ref, _opt(kind, ref.parameters()), 4, ROWS * world, 0, torch.float64, clips[0])
    _train(model, _opt(kind, shards(model)), 4, ROWS, rank * ROWS, torch.float64, clips[1])
    grads = {meta(p).grad_shard.dtype for p in model.parameters() if meta(p).grad_shard is not None}
    return [p.detach() for p in ref.parameters()], full_params(model), grads


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_float64_sharded_training_equals_one_process(world, kind):
    # float64 from end to end: only the order of the data-parallel sum differs (~1e-15 relative)
    for knobs in ({}, {"persistence_threshold": 0}):  # the flat persistent path and per parameter
        for ref_params, got, grads in run(world, _float64_case, kind, knobs):
            assert grads <= {torch.float64}
            for a, b in zip(ref_params, got):
                assert b.dtype == torch.float64
                torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-13)


def test_float64_clipping_by_the_global_norm_equals_torch():
    # the global norm is summed in float64 too (a norm in fp32 would be ~1e-8 off)
    for ref_params, got, _ in run(2, _float64_case, "sgd", {}, 0.05):
        for a, b in zip(ref_params, got):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-13)


def test_float64_would_be_off_with_fp32_grads():
    # the check above can fail: the same run with grads rounded to fp32 is far outside 1e-12
    torch.manual_seed(0)
    ref = Uneven().double()
    rounded = copy.deepcopy(ref)
    _train(ref, _opt("adamw", ref.parameters()), 4, ROWS * 2, 0, torch.float64)
    opt = _opt("adamw", rounded.parameters())
    for step in range(4):
        rounded(_batch(step, ROWS * 2, 0, torch.float64)).backward()
        for p in rounded.parameters():
            p.grad = p.grad.float().double()
        opt.step()
        opt.zero_grad()
    worst = max(((a - b).abs().max() / a.abs().max()).item()
                for a, b in zip(ref.parameters(), rounded.parameters()))
    assert worst > 1e-10  # 100x the tolerance above


def test_grad_dtype_widens_only_past_fp32():
    assert grad_dtype(torch.float64, torch.float32) == torch.float64
    assert grad_dtype(torch.float32, torch.float32) == torch.float32
    assert grad_dtype(torch.float32, torch.bfloat16) == torch.bfloat16
    assert grad_dtype(torch.bfloat16, torch.float32) == torch.float32
    assert grad_dtype(torch.int64, torch.float32) == torch.float32
