"""Which path an optimizer over shards takes: listed element-wise ones and custom element-wise ones
the shards, per-tensor ones (torch's and custom) whole tensors, ones that couple tensors every full
tensor on every rank, and a user's override. The probe steps copies of the user's instance, never
rebuilds it, probes every param group, and is not fooled by an update that is element-wise at first."""

from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.distributed as dist
from harness import run
from optim_catalogue import GlobalNormSGD, MuonAdamW
from test_whole_optim import RTOL, Lamb, Shapes, SignSGD, train_body

from parts.partition import partition_module, shards
from parts.partition.whole import ELEMENT_WISE, probe
from parts.partition.whole.paths import choose


class ClippedAdam(torch.optim.Optimizer):
    """Adam whose step is divided by the tensor's RMS of grad^2 / v where that exceeds 1 (StableAdamW's
    clip): exactly 1 on the first step, per-tensor after it."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                m = state.setdefault("m", torch.zeros_like(p)).mul_(b1).add_(p.grad, alpha=1 - b1)
                v = state.setdefault("v", torch.zeros_like(p)).mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                clip = (p.grad.square() / v.clamp(min=1e-30)).mean().sqrt().clamp(min=1.0)
                p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-group["lr"] / float(clip))


class TwoCalls(torch.optim.Optimizer):
    """An element-wise step that calls its closure twice (a look-ahead at the moved values)."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        for _ in range(2):
            with torch.enable_grad():
                closure()
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        p.sub_(p.grad.sign(), alpha=group["lr"])


def _matrix() -> list[torch.Tensor]:
    return [torch.zeros(3, 4, requires_grad=True), torch.zeros(4, requires_grad=True)]


def test_element_wise_list_and_probe_agree_on_torch_optimizers() -> None:
    for cls in ELEMENT_WISE:
        assert probe(cls(_matrix())).path == "shard", cls.__name__
        assert choose(cls(_matrix()), None).why == "listed element-wise"
    for cls in (torch.optim.Adafactor, torch.optim.Muon, Lamb):
        assert probe(cls(_matrix()[:1])).path == "whole", cls.__name__
    assert probe(SignSGD(_matrix())).path == "shard"


def test_an_update_element_wise_only_on_its_first_step_takes_the_whole_path() -> None:
    assert choose(ClippedAdam(_matrix()), None).path == "whole"


def test_coupled_updates_and_repeated_closures_take_the_replicated_path() -> None:
    found = choose(GlobalNormSGD(_matrix(), lr=1e-1), None)
    assert found.path == "replicated" and "depends on the other tensors" in found.why
    found = choose(TwoCalls(_matrix()), None)
    assert found.path == "replicated" and "calls the closure 2 times" in found.why
    assert choose(torch.optim.LBFGS(_matrix()), None).path == "replicated"


def test_every_param_group_is_probed() -> None:
    matrix, bias = _matrix()
    groups = [{"params": [bias]}, {"params": [matrix], "lr": 2e-2}]
    assert choose(torch.optim.AdamW(groups), None).path == "shard"  # listed: no probe
    mixed = MuonAdamW([bias, matrix])
    mixed.param_groups.reverse()  # its AdamW group first
    assert choose(mixed, None).path == "whole"


def test_the_users_class_is_copied_not_rebuilt_and_generators_are_left_alone() -> None:
    # MuonAdamW's __init__ reads p.ndim of each parameter: rebuilt over group dicts it would raise
    optimizer = MuonAdamW(_matrix())
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    assert choose(optimizer, None).path == "whole"
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == python_state
    assert not optimizer.state and [len(g["params"]) for g in optimizer.param_groups] == [1, 1]


def test_listed_coupled_optimizers_are_known_by_class_name_and_option() -> None:
    Prodigy = type("Prodigy", (torch.optim.SGD,), {})  # any package's Prodigy: not imported, not probed
    assert choose(Prodigy(_matrix(), lr=1.0), None).why == "listed as coupling tensors: Prodigy"
    Lamb = type("Lamb", (torch.optim.Adam,), {})
    groups = [{"params": _matrix(), "pre_norm": True}]
    assert choose(Lamb(groups), None).why == "listed as coupling tensors: Lamb with pre_norm"
    assert choose(Lamb(_matrix()), None).path == "shard"  # without the option: probed (this one is Adam)


def test_sparse_adam_and_second_order_optimizers_are_refused_naming_the_way_out() -> None:
    with pytest.raises(RuntimeError, match="SparseAdam steps sparse grads.*use torch.optim.Adam or AdamW"):
        choose(torch.optim.SparseAdam(_matrix()), None)
    AdaHessian = type("AdaHessian", (torch.optim.SGD,), {})
    with pytest.raises(RuntimeError, match="AdaHessian cannot step a sharded model.*use a first-order optimizer"):
        choose(AdaHessian(_matrix(), lr=1.0), None)


def log_body() -> list[str]:
    import logging
    from parts.partition import attach, detach, route
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logger = logging.getLogger("parts.partition")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        torch.manual_seed(0)
        model = partition_module(Shapes().double())
        attach(model)
        for make in (torch.optim.Adafactor, torch.optim.AdamW, functools.partial(GlobalNormSGD, lr=1e-1)):
            route(make(shards(model)))
        detach(model)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    return records


def test_the_path_is_logged_once_with_what_it_costs() -> None:
    lines = run(2, log_body)[0]
    assert len(lines) == 2, lines  # AdamW is listed: no probe, no line
    assert "Adafactor takes the whole path" in lines[0] and "each owner holds" in lines[0]
    assert "GlobalNormSGD takes the replicated path (its update of each tensor depends on the other" in lines[1]
    assert "every rank holds the full values and grads of all 5 parameters" in lines[1]
    assert "all-gathers the grad shards" in lines[1]


def test_custom_element_wise_optimizer_keeps_the_shard_path_exactly() -> None:
    for result in run(2, train_body, "sign", timeout=120):
        assert result["paths"] == ["shard"]
        assert max(result["errors"].values()) < RTOL, result["errors"]


def test_override_whole_for_adamw_is_exact_and_shard_for_adafactor_is_the_flat_result() -> None:
    for result in run(3, train_body, "adamw", 1, "whole", timeout=120):
        assert result["paths"] == ["whole"] and max(result["errors"].values()) < RTOL
    for result in run(3, train_body, "adafactor", 1, "replicated", timeout=120):
        assert result["paths"] == ["replicated"] and max(result["errors"].values()) < RTOL
    for result in run(3, train_body, "adafactor", 1, "shard", timeout=120):
        assert result["paths"] == ["shard"] and max(result["errors"].values()) > 1e-3  # another algorithm


def _grouping_body():
    torch.manual_seed(0)
    model = partition_module(Shapes().double())
    leaves = shards(model)
    two = [tuple(t.shape) for t in leaves if t.ndim == 2]
    return two, [t.dim() for t in leaves], dist.get_world_size()


def test_shard_leaves_answer_with_the_full_shape_for_grouping() -> None:
    for two, dims, _ in run(3, _grouping_body):
        assert two == [(1, 7), (6, 1), (3, 6), (7, 5)] and dims == [2, 2, 2, 2, 1]
