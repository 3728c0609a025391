"""The first mistakes with a sharded model raise at once and name the fix; world 2.

An optimizer built over ``model.parameters()`` would step gathered copies (lost at the next
refresh) or skip released parameters: its first step raises, naming ``shards(model)``, before
any value changes. ``DistributedDataParallel(model)`` of an attached model raises at the wrap.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run


def _net() -> nn.Module:
    from parts.partition import partitioned
    torch.manual_seed(0)
    with partitioned():
        return nn.Sequential(nn.Embedding(31, 8), nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 31))


def _loss(model: nn.Module) -> torch.Tensor:
    x = torch.randint(0, 31, (3, 5), generator=torch.Generator().manual_seed(dist.get_rank()))
    return model(x).square().mean()


def _full_params_case(threshold: int, fused: bool) -> dict:
    from parts.partition import attach, full_state_dict, use_shards
    model = _net()
    attach(model, persistence_threshold=threshold)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    before = full_state_dict(model, rank0_only=False)
    _loss(model).backward()
    out = {}
    try:
        opt.step()
    except RuntimeError as err:
        out["error"] = str(err)
    after = full_state_dict(model, rank0_only=False)
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    use_shards(opt)  # the fix the message names: the same optimizer, pointed at the shards
    opt.step()
    stepped = full_state_dict(model, rank0_only=False)
    out["stepped"] = all(not torch.equal(before[k], stepped[k]) for k in before)
    return out


@pytest.mark.parametrize("threshold,fused", [(100_000, False), (0, False), (100_000, True)])
def test_an_optimizer_over_model_parameters_raises_at_its_first_step(threshold: int, fused: bool) -> None:
    # persistent params (gathered copies) and released ones (empty) alike; nothing is stepped
    for out in run(2, _full_params_case, threshold, fused):
        assert "AdamW.step()" in out["error"] and "parts.partition.shards(model)" in out["error"]
        assert "parameter '0.weight' (31, 8)" in out["error"]
        assert out["unchanged"] and out["stepped"]


def _ddp_case() -> dict:
    from parts.partition import attach, detach
    model = _net()
    attach(model)
    out = {}
    try:
        torch.nn.parallel.DistributedDataParallel(model)
    except RuntimeError as err:
        out["error"] = str(err)
    _loss(model).backward()  # the model trains on as it is
    detach(model)
    out["marker_after_detach"] = hasattr(model, "_ddp_params_and_buffers_to_ignore")
    return out


def test_a_ddp_wrap_of_an_attached_model_raises() -> None:
    for out in run(2, _ddp_case):
        assert out["error"].startswith("parts models need no DDP wrap")
        assert not out["marker_after_detach"]
