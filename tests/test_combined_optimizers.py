"""A user's class that combines Muon and AdamW by holding them and stepping them from its ``step``
equals one process in float64 over a sharded model at worlds 2 and 3 with no path named: inner
optimizers over slices of its param groups with its state, over its group dicts with states of
their own, or over its parameters in groups of their own. One whose own update also needs whole
tensors beside such held optimizers is refused, naming the way to build it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import RankFailure, run
from test_whole_optim import Shapes, _data, _ns_in_grad_dtype

STEPS, TOL = 4, 1e-9


def _muon_adamw(params: list) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    return (torch.optim.Muon([p for p in params if p.ndim == 2], lr=2e-2),
            torch.optim.AdamW([p for p in params if p.ndim != 2], lr=1e-2))


class SharedSlices(torch.optim.Optimizer):
    """The inner optimizers hold slices of its param group list and its state (docs/optimizers.md)."""

    def __init__(self, params) -> None:
        self.muon, self.adamw = _muon_adamw(list(params))
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        self.muon.step()
        self.adamw.step()


class SharedDicts(SharedSlices):
    """The inner optimizers hold its group dicts in lists and states of their own."""

    def __init__(self, params) -> None:
        self.muon, self.adamw = _muon_adamw(list(params))
        torch.optim.Optimizer.__init__(self, self.muon.param_groups + self.adamw.param_groups, {})


class SameParams(SharedSlices):
    """The inner optimizers hold its parameters in param groups of their own."""

    def __init__(self, params) -> None:
        params = list(params)
        self.muon, self.adamw = _muon_adamw(params)
        torch.optim.Optimizer.__init__(self, params, {"lr": 1e-2})


class SameParamsAndOwnUpdate(SameParams):
    """As SameParams, and its own groups take a step normalised per tensor."""

    @torch.no_grad()
    def step(self, closure=None):
        super().step()
        for p in self.param_groups[0]["params"]:
            p.add_(p.grad / p.grad.norm(), alpha=-1e-2)


KINDS = {"slices of its groups": SharedSlices, "its group dicts": SharedDicts, "its parameters": SameParams,
         "its parameters, and its own update": SameParamsAndOwnUpdate}


def reference(kind: str) -> tuple[dict, dict]:
    """(start, end) of STEPS steps of one process on the unsharded model."""
    restore = _ns_in_grad_dtype([])
    try:
        torch.manual_seed(0)
        model = Shapes().double()
        start = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer = KINDS[kind](list(model.parameters()))
        for step in range(STEPS):
            model(_data(step, None, 1)).backward()
            optimizer.step()
            optimizer.zero_grad()
        return start, {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        restore()


def sharded_body(kind: str) -> dict:
    """STEPS steps of the class over ``shards(model)``, no path named; the full weights."""
    from parts.partition import attach, full_state_dict, partition_module, shards
    rank, world = dist.get_rank(), dist.get_world_size()
    restore = _ns_in_grad_dtype([])
    try:
        torch.manual_seed(0)
        model = partition_module(Shapes().double())
        attach(model)
        optimizer = KINDS[kind](shards(model))
        for step in range(STEPS):
            model(_data(step, rank, world)).backward()
            optimizer.step()
            optimizer.zero_grad()
        return full_state_dict(model, rank0_only=False)
    finally:
        restore()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["slices of its groups", "its group dicts", "its parameters"])
def test_a_class_stepping_the_muon_and_adamw_it_holds_equals_one_process_with_no_path_named(
        kind: str, world: int) -> None:
    start, want = reference(kind)
    got = run(world, sharded_body, kind, timeout=120)[0]
    moved = max(float((want[k] - start[k]).abs().max()) for k in want)
    rel = max(float((got[k] - want[k]).abs().max()) for k in want) / moved
    assert moved > 0 and rel <= TOL, (kind, world, rel)


def test_an_own_update_needing_whole_tensors_beside_optimizers_over_groups_of_their_own_is_refused() -> None:
    with pytest.raises(RankFailure, match="SameParamsAndOwnUpdate holds Muon, AdamW over its parameters in param "
                                          "groups of their own.*self.param_groups"):
        run(2, sharded_body, "its parameters, and its own update", timeout=120)
