"""Every collective parts issues has its tensors on the communication device (``placement_audit``).

Each scenario runs on torch's fake process group, as rank 0 of a world of 2 (4 for the hybrid
layout), with a communication device declared that is not where a stray CPU tensor would be:
``meta`` with the model on meta, or the CPU with the steps under
``torch.set_default_device("meta")`` for what needs values. A scenario passes if it runs,
issues collectives, and none of them sees a tensor off the declared device. The self-test shows
the audit flags a planted CPU tensor and names where parts issued it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import pytest

from placement_audit import Audit, default_device, fake_group, run_scenario
from parts.comm import all_reduce, block_layout, group_info
from parts.partition import (Compression, MixedPrecision, attach, clip_grad_norm_, generating, partitioned,
                             shards)

DIM = 24


def _model(**layout) -> nn.Module:
    torch.manual_seed(0)
    with partitioned(**layout):
        return nn.Sequential(nn.Linear(DIM, 40), nn.LayerNorm(40), nn.GELU(), nn.Linear(40, DIM),
                             nn.Linear(DIM, 1))


def _steps(model: nn.Module, opt, device: str, steps: int = 2, clip: float = 0.0, backward=None) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, DIM, generator=g, device="cpu").to(device)
        loss = model(x).square().mean()
        if backward is None:
            loss.backward()
        else:
            backward(loss)
        if clip:
            clip_grad_norm_(model, clip)
        opt.step()
        opt.zero_grad()


# ------------------------------------------------------------------- meta: the model on meta
def _train_meta(clip: float = 0.0, **knobs) -> None:
    model = _model(device="meta")
    attach(model, **knobs)
    _steps(model, torch.optim.SGD(shards(model), lr=0.1), "meta", clip=clip)


def _bf16_optimizer() -> None:
    from parts.optim import BF16Optimizer
    model = _model(device="meta")
    attach(model)
    opt = BF16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), clip_grad=1.0, allow_fp32=True,
                        named_parameters=model.named_parameters())
    _steps(model, opt, "meta")


def _generation() -> None:
    model = _model(device="meta")
    attach(model)
    with torch.no_grad(), generating(model, memory_budget=1 << 20):  # (meta has no free memory to ask)
        model(torch.randn(2, DIM, device="meta"))


class _Checkpointed(nn.Module):
    """Two blocks run under ``parts.checkpoint.checkpoint``, saved inputs split over the group."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from parts.checkpoint import CheckpointPolicy, checkpoint
        policy = CheckpointPolicy(partition_group=dist.group.WORLD)
        x = checkpoint(lambda y: torch.tanh(self.a(y)), x, policy=policy)
        return self.head(checkpoint(lambda y: torch.tanh(self.b(y)), x, policy=policy))


def _checkpoint_partitioned() -> None:
    torch.manual_seed(0)
    with partitioned(device="meta"):
        model = _Checkpointed()
    attach(model, persistence_threshold=0)
    _steps(model, torch.optim.SGD(shards(model), lr=0.1), "meta")


def _state_dicts() -> None:
    from parts.partition import full_state_dict, load_full_state_dict
    model = _model(device="meta")
    attach(model)
    load_full_state_dict(model, full_state_dict(model, rank0_only=False))


def _hybrid() -> None:
    shard, replica = block_layout(2)
    model = _model(device="meta", group=shard, replicate_group=replica)
    attach(model, persistence_threshold=0)
    _steps(model, torch.optim.SGD(shards(model), lr=0.1), "meta", clip=1.0)


META = {
    "step_mixed_precision": lambda: _train_meta(mixed_precision=MixedPrecision(), persistence_threshold=0),
    "step_flat_persistent": lambda: _train_meta(),
    "clip_grad_norm_": lambda: _train_meta(clip=1.0, persistence_threshold=0),
    "bf16_optimizer_clip": _bf16_optimizer,
    "debug_mode": lambda: _train_meta(debug=True, persistence_threshold=0),
    "generation": _generation,
    "checkpoint_partition_group": _checkpoint_partitioned,
    "full_state_dict": _state_dicts,
    "compression": lambda: _train_meta(compression=Compression(weights="int8", grads="int8"),
                                       persistence_threshold=0),
}


# ------------------------------------------------------------- cpu: values, default device meta
def _offload_step_in_backward(tmp: str) -> None:
    from parts.offload import DiskStore, OffloadedOptimizer
    store = DiskStore(tmp, block_bytes=4096)
    try:
        model = _model(remote_device=store)
        attach(model, persistence_threshold=0)
        opt = OffloadedOptimizer(torch.optim.SGD(shards(model), lr=0.1), store)

        def backward(loss: torch.Tensor) -> None:
            with opt.step_in_backward():
                loss.backward()
        with default_device("meta"):
            _steps(model, opt, "cpu", backward=backward)
    finally:
        store.close()


def _dcp_model() -> tuple:
    model = _model()
    attach(model)
    return model, torch.optim.SGD(shards(model), lr=0.1)


def _dcp_save(tmp: str) -> None:
    """A checkpoint to load (at world 1: a fake world cannot save, its ranks' plans are all rank 0's)."""
    from parts.comm import dcp
    from parts.partition import sharded_optimizer_state_dict, sharded_state_dict
    model, opt = _dcp_model()
    _steps(model, opt, "cpu", steps=1)
    dcp.save({"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, opt)},
             checkpoint_id=tmp)


def _dcp_load(tmp: str) -> None:
    from parts.comm import dcp
    from parts.partition import (load_sharded_optimizer_state_dict, load_sharded_state_dict,
                                 sharded_optimizer_state_dict, sharded_state_dict)
    model, opt = _dcp_model()
    _steps(model, opt, "cpu", steps=1)
    with default_device("meta"):
        state = {"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=tmp)
        load_sharded_state_dict(model, state["model"])
        load_sharded_optimizer_state_dict(model, opt, state["optim"])
        _steps(model, opt, "cpu", steps=1)


def _whole_model() -> tuple:
    model = _model()
    attach(model)
    matrices = [t for t in shards(model) if t.ndim == 2]
    return model, torch.optim.Muon(matrices, lr=2e-2)  # the whole-tensor path: owners hold the state


def _whole_save(tmp: str) -> None:
    """A checkpoint and a full optimizer state of a whole-path optimizer (at world 1, as ``_dcp_save``)."""
    from parts.comm import dcp
    from parts.partition import full_optimizer_state_dict, sharded_optimizer_state_dict
    model, opt = _whole_model()
    _steps(model, opt, "cpu", steps=1)
    dcp.save({"optim": sharded_optimizer_state_dict(model, opt)}, checkpoint_id=tmp)
    torch.save(full_optimizer_state_dict(model, opt), f"{tmp}.pt")


def _whole_resume(tmp: str) -> None:
    """A fresh whole-path optimizer loads the checkpoint, steps, then loads the full state."""
    from parts.comm import dcp
    from parts.partition import (load_full_optimizer_state_dict, load_sharded_optimizer_state_dict,
                                 sharded_optimizer_state_dict)
    model, opt = _whole_model()
    full = torch.load(f"{tmp}.pt", weights_only=True)
    with default_device("meta"):
        state = {"optim": sharded_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=tmp)
        load_sharded_optimizer_state_dict(model, opt, state["optim"])
        _steps(model, opt, "cpu", steps=1)
        load_full_optimizer_state_dict(model, opt, full)


def _objects() -> None:
    from parts.comm import all_gather_objects, broadcast_object
    with default_device("meta"):
        assert all_gather_objects({"rank": dist.get_rank()}) == [{"rank": 0}] * 2
        assert broadcast_object(["a", 1]) == ["a", 1]


def _cpu_steps() -> None:
    model = _model()
    attach(model, debug=True, persistence_threshold=0)
    opt = torch.optim.SGD(shards(model), lr=0.1)
    with default_device("meta"):
        _steps(model, opt, "cpu", clip=1.0)


CPU = {"offload_step_in_backward": _offload_step_in_backward, "dcp_load_at_world_2": _dcp_load,
       "objects": _objects, "step_clip_debug": _cpu_steps, "whole_path_resume_at_world_2": _whole_resume}
SAVED_FIRST = {"dcp_load_at_world_2": _dcp_save, "whole_path_resume_at_world_2": _whole_save}


def _check(out: dict) -> None:
    assert out["error"] is None, out["error"]
    assert not out["violations"], dict(out["violations"])
    assert out["collectives"] > 0  # the scenario did communicate: the audit saw something


@pytest.mark.parametrize("name", sorted(META))
def test_meta_scenario_keeps_every_collective_on_the_comm_device(name):
    with fake_group(2):
        _check(run_scenario(Audit("meta"), META[name], "meta"))


def test_hybrid_layout_keeps_every_collective_on_the_comm_device():
    with fake_group(4):
        _check(run_scenario(Audit("meta"), _hybrid, "meta"))


@pytest.mark.parametrize("name", sorted(CPU))
def test_default_device_scenario_keeps_every_collective_on_the_comm_device(name, tmp_path):
    body, tmp = CPU[name], str(tmp_path)
    if name in SAVED_FIRST:
        with fake_group(1):
            SAVED_FIRST[name](tmp)
    with fake_group(2):
        _check(run_scenario(Audit("cpu"), (lambda: body(tmp)) if name != "objects" and name != "step_clip_debug"
                            else body, "cpu"))


def _planted() -> None:
    info = group_info(None)
    all_reduce(torch.zeros((), device="meta"), info)  # on the device: passes
    all_reduce(torch.zeros(()), info)  # a CPU scalar: NCCL would refuse it


def test_the_audit_flags_a_planted_off_device_tensor():
    with fake_group(2):
        out = run_scenario(Audit("meta"), _planted, "meta")
    assert out["error"] is None and out["collectives"] == 2
    (entry, site, devices), = out["violations"]  # exactly one: the CPU tensor
    assert entry == "all_reduce" and devices == "cpu" and "_planted" in site
