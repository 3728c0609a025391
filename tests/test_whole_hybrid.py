"""The whole-tensor path on hybrid layouts (a 2 x 2 mesh, or the same as two explicit groups):
owners within each shard group, replicas bitwise equal, weights equal one-process Adafactor."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from harness import run
from test_whole_optim import Shapes

STEPS = 6
DTYPE = torch.float64


def _layout(kind: str) -> dict:
    """``partition_module`` arguments for a 2 x 2 layout: a (replicate, shard) mesh or explicit groups."""
    from torch.distributed.device_mesh import init_device_mesh
    rank = dist.get_rank()
    if kind == "mesh":
        return {"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))}
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return {"group": rows[rank // 2], "replicate_group": columns[rank % 2]}


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4 * 6, 5, generator=torch.Generator().manual_seed(step), dtype=DTYPE)


def hybrid_body(kind: str) -> dict:
    from parts.partition import attach, full_state_dict, partition_module, route, shards
    from parts.partition.whole import stepper_of
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = Shapes().to(DTYPE)
    model = partition_module(copy.deepcopy(reference), **_layout(kind))
    attach(model)
    ref_opt = torch.optim.Adafactor(reference.parameters(), lr=1e-2)
    opt = torch.optim.Adafactor(shards(model), lr=1e-2)
    path = route(opt)
    for step in range(STEPS):
        reference(_batch(step)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(_batch(step).chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    got = full_state_dict(model, rank0_only=False)
    stepper = stepper_of(opt)
    return {"path": path, "state": got, "owners": stepper.plan.owners, "group": stepper.info.world_size,
            "errors": {k: float((got[k] - v).norm() / v.norm()) for k, v in reference.state_dict().items()}}


@pytest.mark.parametrize("kind", ["mesh", "groups"])
def test_adafactor_on_a_2x2_hybrid_layout_equals_one_process(kind: str) -> None:
    results = run(4, hybrid_body, kind, timeout=120)
    for r in results:
        assert r["path"] == "whole" and r["group"] == 2  # owners are ranks of the shard group
        assert set(r["owners"]) == {0, 1} and r["owners"] == results[0]["owners"]
        assert max(r["errors"].values()) < 1e-9, r["errors"]
        for k, v in results[0]["state"].items():  # the replicas agree, bitwise
            assert torch.equal(r["state"][k], v), k
