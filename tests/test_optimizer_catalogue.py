"""Every ``torch.optim`` optimizer and a broad catalogue of ``pytorch_optimizer``'s (tests/optim_catalogue.py),
built as users build them over ``shards(model)`` and stepped as their docs say (closures, SAM's
first backward, AliG's loss), equal one process in float64 at world 2 and 3 after five steps
(max difference / max movement <= 1e-9), or are refused with a message that names the way out."""

from __future__ import annotations

import re

import pytest
import torch
from harness import run
from optim_catalogue import catalogue_body, specs

pytest.importorskip("pytorch_optimizer")

TOL = 1e-9
WAY_OUT = re.compile(r"parts\.partition: .*(; use |, use |route\(|shards\(model\))")
"""A refusal names what to do instead: another optimizer, a path, or how to build it."""


def _built() -> dict[str, list[type]]:
    """The classes each catalogued entry builds (over one process's parameters)."""
    from test_whole_optim import Shapes
    params = list(Shapes().double().parameters())
    out = {}
    for name, make in specs().items():
        built = make(params)
        out[name] = [type(o) for o in (built if isinstance(built, list) else [built])]
    return out


def test_the_catalogue_covers_torch_optim_and_more_than_40_of_pytorch_optimizer() -> None:
    classes = {c for built in _built().values() for c in built}
    in_torch = {c for c in vars(torch.optim).values()
                if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
    assert in_torch <= classes, in_torch - classes
    from_po = {c for c in classes if c.__module__.startswith("pytorch_optimizer")}
    assert len(from_po) >= 40, len(from_po)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_every_catalogued_optimizer_equals_one_process_or_is_refused_naming_the_way_out(world: int) -> None:
    names = list(specs())
    results = run(world, catalogue_body, names, timeout=600)[0]
    exact = {n for n, (rel, _) in results.items() if isinstance(rel, float) and rel <= TOL}
    refused = {n for n, (rel, _) in results.items() if isinstance(rel, str) and WAY_OUT.search(rel)}
    wrong = {n: results[n] for n in names if n not in exact | refused}
    assert not wrong, wrong
    assert len(exact) >= 0.75 * len(names), (len(exact), len(names), sorted(refused))
