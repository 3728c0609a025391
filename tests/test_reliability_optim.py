"""Issue 21, BF16Optimizer rows: stale masters, group order on load, rank-asymmetric loads."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import RankFailure, run

from parts.optim import BF16Optimizer

FAST = 30.0  # seconds: a regression that hangs fails here instead of stalling the suite


def mlp(seed: int = 3) -> torch.nn.Module:
    """A small seeded bf16 MLP (uneven sizes)."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.GELU(), torch.nn.Linear(13, 5))
    return net.to(torch.bfloat16)


def pretrained() -> dict:
    """Weights unlike the seeded init: what a user loads after building the optimizer."""
    return {k: v.detach().clone() for k, v in mlp(99).state_dict().items()}


def one_step(model: torch.nn.Module, opt: BF16Optimizer) -> None:
    """One tiny-lr step on rank-dependent data."""
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(dist.get_rank()))
    F.mse_loss(model(x.to(torch.bfloat16)).float(), torch.zeros(4, 5)).backward()
    opt.step()
    opt.zero_grad()


def load_after_build_replicated(via: str) -> float:
    """Replicated model: build the optimizer, then load weights; max |w - loaded| after one step."""
    model, sd = mlp(), pretrained()
    opt = BF16Optimizer(torch.optim.SGD(model.parameters(), lr=1e-9))
    if via == "load_state_dict":
        model.load_state_dict(sd)
    else:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(sd[name])
    one_step(model, opt)
    return max(float((p.detach().float() - sd[n].float()).abs().max()) for n, p in model.named_parameters())


def load_after_build_sharded() -> float:
    """Sharded model: build the optimizer, then load_full_state_dict; the same distance."""
    from parts.partition import full_state_dict, gathered, load_full_state_dict, partition_module
    from parts.partition import reduce_scatter_grads
    model, sd = mlp(), pretrained()
    partition_module(model)
    opt = BF16Optimizer(torch.optim.SGD(model.parameters(), lr=1e-9))
    load_full_state_dict(model, sd if dist.get_rank() == 0 else {})
    with gathered(model.parameters()):
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(dist.get_rank()))
        F.mse_loss(model(x.to(torch.bfloat16)).float(), torch.zeros(4, 5)).backward()
        reduce_scatter_grads(model.parameters())
    opt.step()
    full = full_state_dict(model, rank0_only=False)
    return max(float((full[n].float() - sd[n].float()).abs().max()) for n in sd)


@pytest.mark.parametrize("via", ["load_state_dict", "copy_"])
def test_weights_loaded_after_building_the_optimizer_survive_a_step_replicated(via: str) -> None:
    """Row 1: a step at lr 1e-9 keeps the loaded weights (bf16: an lr-1e-9 update rounds away)."""
    assert run(2, load_after_build_replicated, via, timeout=FAST) == [0.0, 0.0]


def test_weights_loaded_after_building_the_optimizer_survive_a_step_sharded() -> None:
    """Row 1 on a model sharded by parts.partition, loaded with load_full_state_dict."""
    assert run(3, load_after_build_sharded, timeout=FAST) == [0.0, 0.0, 0.0]


def missing_keys_of_rank0_dict() -> tuple:
    """Row 8: load rank 0's dict (other ranks pass {}), once complete and once without a key."""
    from parts.partition import load_full_state_dict, partition_module
    model, sd = mlp(), pretrained()
    partition_module(model)
    full = load_full_state_dict(model, sd if dist.get_rank() == 0 else {})
    del sd["2.bias"]
    part = load_full_state_dict(model, sd if dist.get_rank() == 0 else {}, strict=False)
    return (full.missing_keys, full.unexpected_keys), (part.missing_keys, part.unexpected_keys)


def test_load_full_state_dict_reports_rank0_keys_on_every_rank() -> None:
    """Row 8: every rank reports what was loaded (rank 0's verdict), not its own empty dict."""
    for full, part in run(3, missing_keys_of_rank0_dict, timeout=FAST):
        assert full == ([], [])
        assert part == (["2.bias"], [])
