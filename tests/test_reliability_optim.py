"""BF16Optimizer: stale masters, group order on load, rank-asymmetric loads."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run

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
    """A step at lr 1e-9 keeps the loaded weights (bf16: an lr-1e-9 update rounds away)."""
    assert run(2, load_after_build_replicated, via, timeout=FAST) == [0.0, 0.0]


def test_weights_loaded_after_building_the_optimizer_survive_a_step_sharded() -> None:
    """The same on a model sharded by parts.partition, loaded with load_full_state_dict."""
    assert run(3, load_after_build_sharded, timeout=FAST) == [0.0, 0.0, 0.0]


def missing_keys_of_rank0_dict() -> tuple:
    """Load rank 0's dict (other ranks pass {}), once complete and once without a key."""
    from parts.partition import load_full_state_dict, partition_module
    model, sd = mlp(), pretrained()
    partition_module(model)
    full = load_full_state_dict(model, sd if dist.get_rank() == 0 else {})
    del sd["2.bias"]
    part = load_full_state_dict(model, sd if dist.get_rank() == 0 else {}, strict=False)
    return (full.missing_keys, full.unexpected_keys), (part.missing_keys, part.unexpected_keys)


def test_load_full_state_dict_reports_rank0_keys_on_every_rank() -> None:
    """Every rank reports what was loaded (rank 0's verdict), not its own empty dict."""
    for full, part in run(3, missing_keys_of_rank0_dict, timeout=FAST):
        assert full == ([], [])
        assert part == (["2.bias"], [])


def _grouped(model: torch.nn.Module, order: list[int], lrs: list[float]) -> BF16Optimizer:
    """SGD with one param group per listed layer index (in ``order``), named params."""
    groups = [{"params": list(model[i].parameters()), "lr": lr} for i, lr in zip(order, lrs)]
    return BF16Optimizer(torch.optim.SGD(groups, lr=1.0), named_parameters=model.named_parameters())


def groups_in_another_order() -> tuple:
    """Save with groups (layer 0 lr .1, layer 2 lr .2), load into (layer 2, layer 0)."""
    model = mlp()
    saved = _grouped(model, [0, 2], [0.1, 0.2])
    one_step(model, saved)
    sd = dist_gather(saved.state_dict())
    other = mlp()
    target = _grouped(other, [2, 0], [0.5, 0.6])
    target.load_state_dict(sd)
    same = all(torch.equal(target.full_fp32_param(q), saved.full_fp32_param(p))
               for p, q in zip(model.parameters(), other.parameters()))
    merged = _grouped(mlp(), [0], [0.3])  # layer 0 alone: its saved group's lr
    merged.load_state_dict(sd, strict=False)
    both = mlp()
    both_opt = BF16Optimizer(torch.optim.SGD(both.parameters(), lr=0.7),
                             named_parameters=both.named_parameters())
    try:
        both_opt.load_state_dict(sd)
        conflict = "no error"
    except ValueError as exc:
        conflict = str(exc)
    return [g["lr"] for g in target.param_groups], same, merged.param_groups[0]["lr"], conflict


def dist_gather(obj: object) -> list:
    """Every rank's object (the per-rank state dicts a user would save and load)."""
    from parts.comm import all_gather_objects
    return all_gather_objects(obj)


def test_load_state_dict_matches_groups_by_parameter_not_position() -> None:
    """Settings follow the params by name; a group mixing saved settings raises."""
    for lrs, same, merged_lr, conflict in run(2, groups_in_another_order, timeout=FAST):
        assert lrs == [0.2, 0.1] and same and merged_lr == 0.1
        assert "param group 0 holds parameters saved in param groups 0 and 1" in conflict, conflict


def load_rank_asymmetric(case: str) -> tuple:
    """One rank cannot load (a saved rank's dict missing, or None); every rank must raise."""
    model = mlp()
    opt = BF16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                        named_parameters=model.named_parameters())
    one_step(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    if case == "missing rank":
        source = [dist_gather(opt.state_dict())[0]]  # only saved rank 0: rank 1 needs its own
    else:
        full = opt.consolidated_state_dict()  # None on rank 1, as it returns there
        source = full
    try:
        opt.load_state_dict(source)
        outcome = "loaded"
    except Exception as exc:  # noqa: BLE001 - the outcome is what is checked
        outcome = f"{type(exc).__name__}: {exc}"
    flag = torch.ones(1)
    dist.all_reduce(flag)  # the ranks are still in step: no one is stuck in a collective
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return outcome, float(flag), unchanged


@pytest.mark.parametrize("case", ["missing rank", "None on rank 1"])
def test_load_state_dict_failing_on_one_rank_raises_on_every_rank(case: str) -> None:
    """The rank that cannot load says why, the others name it; nothing changed, no hang."""
    (out0, flag0, same0), (out1, flag1, same1) = run(2, load_rank_asymmetric, case, timeout=FAST)
    assert flag0 == flag1 == 2.0 and same0 and same1
    assert out0.startswith("RankDisagreement") and "rank 1:" in out0, out0
    why = "needs the state dict of saved rank 1 of 2" if case == "missing rank" else \
        "consolidated_state_dict() returns None on every rank but 0"
    assert out1.startswith("ValueError") and why in out1, out1


def subgroup_model_world_optimizer() -> str:
    """Model sharded over ranks [0, 1] of 3; BF16Optimizer built without group=."""
    from datetime import timedelta

    from parts.partition import gathered, partition_module, reduce_scatter_grads
    sub = dist.new_group([0, 1], timeout=timedelta(seconds=10))
    alone = dist.new_group([2], timeout=timedelta(seconds=10))
    model = mlp()
    if dist.get_rank() == 2:
        partition_module(model, group=alone)  # every rank takes part in each build's layout agreement
        return "not in the sub-group"
    partition_module(model, group=sub)
    try:
        opt = BF16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    except ValueError as exc:
        return str(exc)
    with gathered(model.parameters()):
        model(torch.ones(2, 7, dtype=torch.bfloat16)).float().sum().backward()
        reduce_scatter_grads(model.parameters())
    opt.step()  # waited on rank 2 (the world group) until the process-group timeout
    return "stepped"


def test_subgroup_sharded_model_with_a_world_optimizer_raises() -> None:
    """A clear error at construction naming the param and both rank lists, not a hang."""
    out = run(3, subgroup_model_world_optimizer, timeout=FAST)
    assert out[2] == "not in the sub-group"
    for msg in out[:2]:
        assert "parameter '0.weight' is sharded over global ranks [0, 1]" in msg, msg
        assert "group=None, the default group) has global ranks [0, 1, 2]" in msg, msg
