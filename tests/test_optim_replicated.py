"""The replicated path and closures: optimizers that couple tensors (a global norm, a line search)
equal one process in float64; ``step(closure)`` works on every path; the ranks' full copies are
checked and healed; element-wise optimizers keep the shard path and add no bytes to a step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from harness import run
from optim_catalogue import GlobalNormSGD, catalogue_body, step_both
from test_whole_hybrid import _layout
from test_whole_optim import Shapes

from parts.partition import attach, detach, full_state_dict, partition_module, route, shards

TOL = 1e-9


@pytest.mark.parametrize("world", [2, 3])
def test_line_searches_a_global_norm_and_closures_on_every_path_equal_one_process(world: int) -> None:
    names = ["LBFGS", "LBFGS(strong_wolfe)", "GlobalNormSGD (user class)", "SGD(closure)", "Adafactor(closure)",
             "MuonAdamW (user class)"]
    results = run(world, catalogue_body, names, timeout=180)[0]
    paths = {name: path for name, (_, path) in results.items()}
    assert paths == {"LBFGS": "replicated", "LBFGS(strong_wolfe)": "replicated",
                     "GlobalNormSGD (user class)": "replicated", "SGD(closure)": "shard",
                     "Adafactor(closure)": "whole", "MuonAdamW (user class)": "whole"}, paths
    for name, (rel, _) in results.items():
        assert isinstance(rel, float) and rel <= TOL, (name, rel)


def test_any_optimizer_named_to_the_replicated_path_equals_one_process() -> None:
    results = run(3, catalogue_body, ["AdamW", "Adafactor", "SGD(closure)"], "replicated", timeout=180)[0]
    for name, (rel, path) in results.items():
        assert path == "replicated" and isinstance(rel, float) and rel <= TOL, (name, rel, path)


def _bytes_per_step(model, opt, x) -> int:
    from parts.comm import comm_counter
    before = sum(v for k, v in comm_counter.snapshot().items() if k.endswith("_bytes"))
    model(x).square().mean().backward()
    if opt is not None:
        opt.step()
        opt.zero_grad()
    return sum(v for k, v in comm_counter.snapshot().items() if k.endswith("_bytes")) - before


def bytes_body(kind: str) -> dict:
    from parts.comm import wire_bytes
    from parts.partition import meta
    torch.manual_seed(0)
    model = partition_module(torch.nn.Sequential(*[torch.nn.Linear(24, 24) for _ in range(3)]))
    attach(model, persistence_threshold=0)
    leaves = shards(model)
    opt = {"none": None, "adamw": lambda: torch.optim.AdamW(leaves), "sgd": lambda: torch.optim.SGD(leaves, lr=1e-2),
           "replicated": lambda: route_to(torch.optim.AdamW(leaves), "replicated")}[kind]
    opt = opt() if opt else None
    x = torch.randn(4, 24)
    moved = [_bytes_per_step(model, opt, x) for _ in range(3)]
    world = dist.get_world_size()
    grads = sum(meta(p).layout.shard_numel for p in model.parameters()) * 4
    flags = (len(list(model.parameters())) + 2) * 8
    detach(model)
    return {"steady": moved[-1], "path": route(opt) if opt else None,
            "gather_grads": wire_bytes(grads, world), "flags": 2 * wire_bytes(flags, world) // world}


def route_to(opt, path):
    route(opt, path)
    return opt


def test_adamw_and_sgd_take_the_shard_path_and_their_step_moves_no_byte() -> None:
    plain = run(2, bytes_body, "none")[0]["steady"]  # forward and backward alone
    for kind in ("adamw", "sgd"):
        got = run(2, bytes_body, kind)[0]
        assert got["path"] == "shard" and got["steady"] == plain, (kind, got, plain)


def test_the_replicated_path_adds_one_all_gather_of_the_grad_shards_per_step() -> None:
    plain = run(3, bytes_body, "none")[0]["steady"]
    got = run(3, bytes_body, "replicated")[0]
    assert got["path"] == "replicated"
    assert got["steady"] - plain == got["gather_grads"] + got["flags"], (got, plain)


def drift_body() -> dict:
    import logging
    from parts.partition.whole import stepper_of
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = Shapes().double()
    model = partition_module(copy.deepcopy(reference))
    attach(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(shards(model), lr=1e-2)
    route(opt, "replicated")
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: warnings.append(r.getMessage())
    logging.getLogger("parts.partition").addHandler(handler)
    try:
        for step in range(6):
            x = torch.randn(12, 5, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
            reference(x).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            model(x.chunk(world)[rank]).backward()
            opt.step()
            opt.zero_grad()
            if step == 2 and rank == 1:  # this rank's copies drift: a value its shard does not hold, and state
                full = stepper_of(opt).tensors[3]
                full.detach().add_(1.0)
                opt.state[full]["exp_avg"].add_(1.0)
    finally:
        logging.getLogger("parts.partition").removeHandler(handler)
    got = full_state_dict(model, rank0_only=False)
    detach(model)
    return {"warnings": warnings, "errors": {k: float((got[k] - v).abs().max()) for k, v in
                                             reference.state_dict().items()}}


def test_copies_that_drift_apart_are_taken_again_from_the_shards_and_the_owners() -> None:
    for r in run(3, drift_body, timeout=120):
        assert max(r["errors"].values()) < 1e-12, r["errors"]
        assert any("full copies of AdamW's parameters or state differ" in w for w in r["warnings"]), r["warnings"]


def hybrid_body() -> dict:
    from parts.partition.whole import stepper_of
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = Shapes().double()
    model = partition_module(copy.deepcopy(reference), **_layout("groups"))
    attach(model)
    ref_opt = torch.optim.LBFGS(reference.parameters(), lr=0.5, max_iter=4)
    opt = torch.optim.LBFGS(shards(model), lr=0.5, max_iter=4)
    losses = []
    for step in range(3):
        x = torch.randn(24, 5, generator=torch.Generator().manual_seed(step), dtype=torch.float64)

        def ref_closure():
            ref_opt.zero_grad()
            loss = reference(x)
            loss.backward()
            return loss

        def closure():
            opt.zero_grad()
            loss = model(x.chunk(world)[rank])
            loss.backward()
            return loss
        one = ref_opt.step(ref_closure)
        losses.append((float(opt.step(closure)), float(one.detach())))
    got = full_state_dict(model, rank0_only=False)
    group = stepper_of(opt).info.world_size
    detach(model)
    return {"group": group, "losses": losses,
            "errors": {k: float((got[k] - v).abs().max()) for k, v in reference.state_dict().items()}}


def test_lbfgs_on_a_2x2_hybrid_layout_equals_one_process_and_sees_its_loss() -> None:
    for r in run(4, hybrid_body, timeout=120):
        assert r["group"] == 2 and max(r["errors"].values()) < 1e-12, r
        assert all(abs(sharded - one) < 1e-12 for sharded, one in r["losses"]), r["losses"]


def early_route_body(path: str) -> dict:
    torch.manual_seed(0)
    reference = Shapes().double()
    model = partition_module(copy.deepcopy(reference))
    attach(model, persistence_threshold=0)  # nothing gathered before the first forward
    make = {"replicated": GlobalNormSGD, "whole": torch.optim.Adafactor}[path]
    ref_opt, opt = make(reference.parameters(), lr=1e-2), make(shards(model), lr=1e-2)
    taken = route(opt)  # right after building, before any forward
    for step in range(4):
        step_both(reference, model, (ref_opt, opt), step)
    got = full_state_dict(model, rank0_only=False)
    detach(model)
    return {"path": taken, "errors": {k: float((got[k] - v).abs().max()) for k, v in reference.state_dict().items()}}


@pytest.mark.parametrize("path", ["replicated", "whole"])
def test_a_path_settled_before_the_first_forward_takes_every_parameter(path: str) -> None:
    for r in run(2, early_route_body, path, timeout=120):
        assert r["path"] == path and max(r["errors"].values()) < 1e-12, r
