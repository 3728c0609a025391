"""Optimizers that wrap or combine others over a sharded model equal one process in float64:
Lookahead (state made in its constructor) takes its inner optimizer's path or the one named,
SAM and the optimizers that couple tensors take the replicated path, Muon's AdamW group listed
first and StableAdamW's per-tensor clip are seen by the probe; an EMA of the weights
(``torch.optim.swa_utils.AveragedModel``) made and updated as the refusal of a copy of the sharded
model says is exact."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from harness import RankFailure, run
from optim_catalogue import catalogue_body, step_both
from test_whole_optim import Shapes

TOL = 1e-9
needs_po = pytest.mark.skipif(importlib.util.find_spec("pytorch_optimizer") is None,
                              reason="pytorch_optimizer (the [test] extra) is not installed")

ROWS = {
    "po.LBFGS": "replicated", "po.SAM(AdamW)": "replicated", "po.Muon(adamw first)": "whole",
    "po.StableAdamW": "whole", "po.Prodigy": "replicated", "po.DAdaptAdam": "replicated",
    "po.AdamS": "replicated", "po.Lamb(pre_norm)": "replicated", "po.Ranger21": "replicated",
    "po.Lookahead(AdamW)": "shard", "po.Lookahead(Adafactor)": "whole", "MuonAdamW (user class)": "whole",
}
"""Optimizers that ran silently wrong or crashed over shards when the probe read one group for two
steps and an owner's sums covered its own tensors only, and the path each takes."""


@needs_po
def test_coupled_wrapped_and_combined_optimizers_take_their_paths_and_equal_one_process() -> None:
    results = run(3, catalogue_body, list(ROWS), timeout=240)[0]
    assert {name: path for name, (_, path) in results.items()} == ROWS
    for name, (rel, _) in results.items():
        assert isinstance(rel, float) and rel <= TOL, (name, rel)


@needs_po
@pytest.mark.parametrize("path", ["whole", "replicated"])
def test_a_path_named_for_lookahead_is_taken_and_exact(path: str) -> None:
    results = run(2, catalogue_body, ["po.Lookahead(AdamW)", "po.Lookahead(Adafactor)"], path, timeout=120)[0]
    for name, (rel, taken) in results.items():
        assert taken == path and isinstance(rel, float) and rel <= TOL, (name, rel, taken)


def inner_body() -> None:
    import pytorch_optimizer
    from parts.partition import attach, partition_module, shards
    torch.manual_seed(0)
    model = partition_module(Shapes().double())
    attach(model)
    lookahead = pytorch_optimizer.Lookahead(torch.optim.Adafactor(shards(model), lr=1e-2), k=2)
    model(torch.randn(4, 5, dtype=torch.float64)).backward()
    lookahead.step()
    lookahead.optimizer.step()


@needs_po
def test_stepping_the_optimizer_a_wrapper_holds_is_refused_naming_the_wrapper() -> None:
    with pytest.raises(RankFailure, match="Adafactor is held by an optimizer that takes the whole path.*step that"):
        run(2, inner_body)


def ema_body(copy_outside: bool) -> dict:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    from parts.partition import attach, detach, full_state_dict, gathered, partition_module, shards
    torch.manual_seed(0)
    reference = Shapes().double()
    model = partition_module(copy.deepcopy(reference))
    attach(model, persistence_threshold=0)  # parameters are released between forwards
    if copy_outside:
        AveragedModel(model)
    ref_ema = AveragedModel(reference, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    plain = Shapes().double()  # the same class, unsharded, with the sharded model's weights
    plain.load_state_dict(full_state_dict(model, rank0_only=False))
    ema = AveragedModel(plain, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ref_opt, opt = torch.optim.AdamW(reference.parameters(), lr=1e-2), torch.optim.AdamW(shards(model), lr=1e-2)
    for step in range(4):
        step_both(reference, model, (ref_opt, opt), step)
        ref_ema.update_parameters(reference)
        with gathered(list(model.parameters())):
            ema.update_parameters(model)
    want, got = ref_ema.module.state_dict(), ema.module.state_dict()
    detach(model)
    return {k: float((got[k] - v).abs().max()) for k, v in want.items()}


def test_an_ema_of_an_unsharded_copy_updated_inside_gathered_equals_one_process() -> None:
    for errors in run(2, ema_body, False):
        assert max(errors.values()) < 1e-12, errors


def test_an_averaged_model_of_the_sharded_model_is_refused_naming_the_way_that_works() -> None:
    with pytest.raises(RankFailure, match=r"AveragedModel.*average an unsharded model.*ema.update_parameters"):
        run(2, ema_body, True)
