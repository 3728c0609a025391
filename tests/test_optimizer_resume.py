"""Every optimizer path (shard, whole, replicated) resumes into a fresh, never-stepped optimizer:
saved at world 2 after 3 steps, resumed at world 3 and at world 2 (a fresh model, fresh
optimizers, a new harness call), 3 more steps equal 6 uninterrupted steps of one process in
float64. Through DCP with ``load_sharded_optimizer_state_dict``, through
``full_optimizer_state_dict`` / ``load_full_optimizer_state_dict``, through accelerate's
``save_state`` / ``load_state``; the drop-in Trainer's ``resume_from_checkpoint`` is in
test_optimizer_resume_trainer.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import RankFailure, run
from test_whole_optim import Shapes, _data, _ns_in_grad_dtype

try:  # imported here, so that the harness's forked workers have it already
    from transformers.optimization import Adafactor as TransformersAdafactor
except ImportError:
    TransformersAdafactor = None

SAVE_AFTER, STEPS, RTOL = 3, 6, 1e-9
PATHS = {"muon+adamw": ["whole", "shard"], "muon+adamw in one": ["whole"], "torch adafactor": ["whole"],
         "transformers adafactor": ["whole"], "adamw": ["shard"], "global-norm sgd": ["replicated"]}
KINDS = ["muon+adamw", "muon+adamw in one", "torch adafactor", "transformers adafactor", "adamw",
         "global-norm sgd"]


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the 2-D weights, AdamW on the rest, as one optimizer (what a Trainer takes): the inner
    optimizers share its param group dicts and its state, so its ``state_dict()`` is torch's layout."""

    def __init__(self, params, lr: float = 2e-2, adamw_lr: float = 1e-2) -> None:
        params = list(params)
        self.muon = torch.optim.Muon([p for p in params if p.ndim == 2], lr=lr)
        self.adamw = torch.optim.AdamW([p for p in params if p.ndim != 2], lr=adamw_lr)
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})
        self._share()

    def _share(self) -> None:
        split = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:split], self.param_groups[split:]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # new group dicts and state: share them again
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        self.muon.step()
        self.adamw.step()


class GlobalNormSGD(torch.optim.Optimizer):
    """Momentum SGD on grads divided by the global grad norm: its update couples every tensor (the
    replicated path), with a tensor and a scalar of state per parameter."""

    def __init__(self, params, lr: float = 1e-2, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.sqrt(sum((g * g).sum() for g in grads)).clamp(min=1e-12)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"], state["m"] = torch.tensor(0.0, dtype=torch.float64), torch.zeros_like(p)
                state["step"] += 1
                state["m"].mul_(group["momentum"]).add_(p.grad / norm)
                p.add_(state["m"], alpha=-group["lr"])


def optimizers(kind: str, leaves: list) -> list[torch.optim.Optimizer]:
    """The optimizers of ``kind`` over ``leaves`` (``shards(model)`` or a plain model's parameters)."""
    two, rest = [t for t in leaves if t.ndim == 2], [t for t in leaves if t.ndim != 2]
    if kind == "muon+adamw":
        return [torch.optim.Muon(two, lr=2e-2), torch.optim.AdamW(rest, lr=1e-2)]
    if kind == "muon+adamw in one":
        return [MuonAdamW(leaves)]
    if kind == "torch adafactor":
        return [torch.optim.Adafactor(leaves, lr=1e-2)]
    if kind == "global-norm sgd":
        return [GlobalNormSGD(leaves)]
    if kind == "transformers adafactor":
        return [TransformersAdafactor(leaves, lr=1e-2, relative_step=False)]  # scale_parameter: the tensor's RMS
    return [torch.optim.AdamW(leaves, lr=1e-2)]


def reference(kind: str) -> dict[str, torch.Tensor]:
    """One process, the unsharded model, STEPS steps on the whole batch."""
    restore = _ns_in_grad_dtype([])
    try:
        torch.manual_seed(0)
        model = Shapes().double()
        opts = optimizers(kind, list(model.parameters()))
        for step in range(STEPS):
            model(_data(step, None, 1)).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    finally:
        restore()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fresh(kind: str, seed: int) -> tuple:
    """A sharded model from ``seed`` and fresh optimizers over its shards."""
    from parts.partition import attach, partition_module, route, shards
    torch.manual_seed(seed)
    model = partition_module(Shapes().double())
    attach(model)
    opts = optimizers(kind, shards(model))
    if kind == "muon+adamw in one":
        route(opts[0], "whole")  # Muon needs whole matrices, and AdamW is exact on them too
    paths = [route(o) for o in opts]
    assert paths == PATHS[kind], (kind, paths)
    return model, opts


def _steps(model, opts, steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        model(_data(step, rank, world)).backward()
        for o in opts:
            o.step()
            o.zero_grad()


def save_body(path: str, kind: str) -> None:
    """SAVE_AFTER steps at this world size, then a DCP checkpoint and a full state file (rank 0)."""
    from parts.comm import dcp
    from parts.partition import full_optimizer_state_dict, full_state_dict, sharded_optimizer_state_dict, \
        sharded_state_dict
    restore = _ns_in_grad_dtype([])
    try:
        model, opts = _fresh(kind, 0)
        _steps(model, opts, range(SAVE_AFTER))
        dcp.save({"model": sharded_state_dict(model),
                  **{f"optim{i}": sharded_optimizer_state_dict(model, o) for i, o in enumerate(opts)}},
                 checkpoint_id=os.path.join(path, "dcp"))
        full = {"model": full_state_dict(model), "optim": [full_optimizer_state_dict(model, o) for o in opts]}
        if dist.get_rank() == 0:
            torch.save(full, os.path.join(path, "full.pt"))
        dist.barrier()
    finally:
        restore()


def _load_full(path: str, model, opts: list) -> None:
    """Load the full state file global rank 0 reads (the others pass None) into ``model`` and ``opts``."""
    from parts.partition import load_full_optimizer_state_dict, load_full_state_dict
    full = torch.load(os.path.join(path, "full.pt"), weights_only=True) if dist.get_rank() == 0 else None
    load_full_state_dict(model, full["model"] if full else None)
    for i, o in enumerate(opts):
        load_full_optimizer_state_dict(model, o, full["optim"][i] if full else None)


def resume_body(path: str, kind: str, how: str) -> dict[str, torch.Tensor]:
    """A fresh model and never-stepped optimizers load the checkpoint (``how``), then step to STEPS."""
    from parts.comm import dcp
    from parts.partition import (full_state_dict, load_sharded_optimizer_state_dict, load_sharded_state_dict,
                                 sharded_optimizer_state_dict, sharded_state_dict)
    restore = _ns_in_grad_dtype([])
    try:
        model, opts = _fresh(kind, 1)
        if how == "dcp":
            state = {"model": sharded_state_dict(model),
                     **{f"optim{i}": sharded_optimizer_state_dict(model, o) for i, o in enumerate(opts)}}
            dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
            load_sharded_state_dict(model, state["model"])
            for i, o in enumerate(opts):
                load_sharded_optimizer_state_dict(model, o, state[f"optim{i}"])
        else:
            _load_full(path, model, opts)
        _steps(model, opts, range(SAVE_AFTER, STEPS))
        return full_state_dict(model, rank0_only=False)
    finally:
        restore()


def _assert_close(got: dict, expected: dict, where: str) -> None:
    errors = {k: float((got[k] - v).norm() / v.norm()) for k, v in expected.items()}
    assert max(errors.values()) < RTOL, (where, errors)


@pytest.mark.parametrize("kind", KINDS)
def test_a_fresh_optimizer_resumes_at_world_3_and_2_as_six_uninterrupted_steps(tmp_path: Path, kind: str) -> None:
    if kind.startswith("transformers") and TransformersAdafactor is None:
        pytest.skip("transformers is not installed")
    run(2, save_body, str(tmp_path), kind, timeout=120)
    expected = reference(kind)
    for world in (3, 2):
        for how in ("dcp", "full"):
            _assert_close(run(world, resume_body, str(tmp_path), kind, how, timeout=120)[0], expected,
                          f"{kind} saved at world 2, resumed at world {world} through {how}")


def hybrid_body(path: str, kind: str) -> dict[str, torch.Tensor]:
    """A fresh 2 x 2 hybrid model (shard groups of 2, two replicas) loads the full state global rank 0
    read (the others pass None), then steps to STEPS."""
    from torch.distributed.device_mesh import init_device_mesh

    from parts.partition import attach, full_state_dict, partition_module, shards
    restore = _ns_in_grad_dtype([])
    try:
        torch.manual_seed(1)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = partition_module(Shapes().double(), mesh=mesh)
        attach(model)
        opts = optimizers(kind, shards(model))
        _load_full(path, model, opts)
        _steps(model, opts, range(SAVE_AFTER, STEPS))
        return full_state_dict(model, rank0_only=False)
    finally:
        restore()


def test_a_full_optimizer_state_from_global_rank_0_resumes_a_2x2_hybrid_layout(tmp_path: Path) -> None:
    run(2, save_body, str(tmp_path), "muon+adamw", timeout=120)
    expected = reference("muon+adamw")
    for got in run(4, hybrid_body, str(tmp_path), "muon+adamw", timeout=120):
        _assert_close(got, expected, "muon+adamw saved at world 2, resumed on a 2 x 2 hybrid layout")


class NestedMuonAdamW(torch.optim.Optimizer):
    """Muon + AdamW in one, each inner optimizer with its own state: ``state_dict()`` nests theirs."""

    def __init__(self, params) -> None:
        params = list(params)
        self.muon = torch.optim.Muon([p for p in params if p.ndim == 2])
        self.adamw = torch.optim.AdamW([p for p in params if p.ndim != 2])
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})

    @torch.no_grad()
    def step(self, closure=None):
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}


def nested_body() -> str:
    from parts.partition import route, sharded_optimizer_state_dict, shards
    model, _ = _fresh("adamw", 0)
    optimizer = NestedMuonAdamW(shards(model))
    route(optimizer, "whole")
    try:
        sharded_optimizer_state_dict(model, optimizer)
    except TypeError as error:
        return str(error)
    return "saved"


def test_an_optimizer_whose_state_dict_is_not_torchs_layout_is_refused_naming_what_it_lacks() -> None:
    for message in run(2, nested_body, timeout=60):
        assert "NestedMuonAdamW.state_dict() is not in torch's layout: it has no ['state', 'param_groups']" in message
        assert "(it has ['adamw', 'muon'])" in message and "load_sharded_state_dict(model, state)" in message


def accelerate_body(path: str, kind: str, resume: bool) -> dict[str, torch.Tensor]:
    """accelerate's loop: SAVE_AFTER steps then ``save_state`` (resume False), or a fresh model and
    optimizers, ``load_state``, and the steps up to STEPS (resume True)."""
    from accelerate.state import AcceleratorState, GradientState

    from parts.integrations.accelerate import Accelerator, prepare
    from parts.partition import full_state_dict, partition_module, shards
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    restore = _ns_in_grad_dtype([])
    AcceleratorState._reset_state()
    GradientState._reset_state()
    try:
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(1 if resume else 0)
        model = partition_module(Shapes().double())
        model, *opts = prepare(accelerator, model, *optimizers(kind, shards(model)))
        if resume:
            accelerator.load_state(path)
        rank, world = dist.get_rank(), dist.get_world_size()
        for step in range(SAVE_AFTER, STEPS) if resume else range(SAVE_AFTER):
            accelerator.backward(model(_data(step, rank, world)))
            for o in opts:
                o.step()
                o.zero_grad()
        if not resume:
            accelerator.save_state(path)
        return full_state_dict(model, rank0_only=False)
    finally:
        AcceleratorState._reset_state()
        GradientState._reset_state()
        restore()


@pytest.mark.parametrize("kind", ["muon+adamw", "torch adafactor"])
def test_accelerate_load_state_resumes_a_fresh_optimizer_at_world_3_and_2(tmp_path: Path, kind: str) -> None:
    pytest.importorskip("accelerate")
    out = str(tmp_path / "state")
    run(2, accelerate_body, out, kind, False, timeout=120)
    expected = reference(kind)
    for world in (3, 2):
        _assert_close(run(world, accelerate_body, out, kind, True, timeout=120)[0], expected,
                      f"{kind} through accelerate, resumed at world {world}")


def test_load_full_optimizer_state_dict_refuses_state_of_parameters_it_does_not_step(tmp_path: Path) -> None:
    run(2, save_body, str(tmp_path), "adamw", timeout=120)
    with pytest.raises(RankFailure, match=r"load_full_optimizer_state_dict: the state does not fit the optimizer: "
                                          r"state for parameters it does not step \['a.bias'\]"):
        run(2, mismatched_body, str(tmp_path), timeout=60)


def mismatched_body(path: str) -> None:
    """An optimizer over every parameter but ``a.bias`` loads a state that has it."""
    from parts.partition import load_full_optimizer_state_dict, shards
    model, _ = _fresh("adamw", 1)
    optimizer = torch.optim.AdamW(shards([p for n, p in model.named_parameters() if n != "a.bias"]), lr=1e-2)
    full = torch.load(os.path.join(path, "full.pt"), weights_only=True) if dist.get_rank() == 0 else None
    load_full_optimizer_state_dict(model, optimizer, full["optim"][0] if full else None)
