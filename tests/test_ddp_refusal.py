"""``DistributedDataParallel`` of any module holding sharded parameters raises as it is made, naming the fix.

Frameworks wrap what they are given: Lightning's ``strategy="ddp"`` wraps the LightningModule,
the parent of the parts model. Whether the wrapped module is the attached model, a parent of
it, or holds parameters sharded but not attached, and whether its parameters are released or
kept gathered after a step, the wrap raises "parts models need no DDP wrap" on every rank
before DDP's first collective, and the model trains on.
"""

from __future__ import annotations

import torch
from torch import nn

from harness import run


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))


def _step(model: nn.Module) -> None:
    model(torch.randn(4, 8)).square().mean().backward()


def _wrap(module: nn.Module) -> str:
    try:
        nn.parallel.DistributedDataParallel(module)
    except RuntimeError as err:
        return str(err)
    return "wrapped"


def _cases() -> dict:
    from parts.partition import attach, detach, partition_module, partitioned
    with partitioned():
        sharded = _net()
    parent = nn.ModuleDict({"head": nn.Linear(2, 2), "body": sharded})
    out = {"sharded parent": _wrap(parent)}
    attach(sharded)
    out["attached parent"] = _wrap(parent)
    _step(sharded)  # persistent parameters now gathered for good
    out["gathered parent"] = _wrap(parent)
    out["attached"] = _wrap(sharded)
    _step(sharded)  # trains on
    detach(sharded)
    out["plain"] = _wrap(_net())  # a model without sharded parameters wraps as ever
    later = partition_module(_net())
    out["partition_module"] = _wrap(nn.Sequential(later))
    return out


def test_a_ddp_wrap_of_a_module_holding_sharded_parameters_raises_naming_the_fix() -> None:
    for out in run(2, _cases):
        assert out.pop("plain") == "wrapped"
        for case, message in out.items():
            assert message.startswith("parts models need no DDP wrap"), (case, message)
            assert 'strategy="parts"' in message and "PartsStrategy" in message, case
        assert "DistributedDataParallel(ModuleDict) would wrap parameter '0.weight'" in out["sharded parent"]
