"""The equivalence tests of the coordinator and of hybrid layouts, in reproducible mode: where the
default mode's sharded runs match by a tolerance (they sum in another fp32 order at each world
size and layout), ``attach(model, reproducible=True)`` with ``backward_units`` gives the same bits
at world 1, 2 and 3, and over full sharding, a 2 x 2 and a 4 x 1 hybrid layout at world 4."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run
from test_coordinator_models import GPT, batch, full_params, make_pair
from test_hybrid import LR, _batches, _layout, _model

STEPS, UNITS, ROWS = 4, 6, 2  # ROWS sequences per unit


def _gpt_loss(model: torch.nn.Module, rows: tuple) -> torch.Tensor:
    return model(*rows)


def gpt_run(knobs: dict) -> tuple:
    """The coordinator tests' GPT, AdamW, ``STEPS`` steps of ``UNITS`` units: losses, full params."""
    from parts.partition import attach, backward_units, shards
    _, model = make_pair(GPT)
    attach(model, reproducible=True, **knobs)
    opt = torch.optim.AdamW(shards(model), lr=1e-2)
    losses = []
    for step in range(STEPS):
        losses.append(float(backward_units(model, batch(step, UNITS * ROWS), UNITS, _gpt_loss)))
        opt.step()
        opt.zero_grad()
    return losses, full_params(model)


@pytest.mark.parametrize("knobs", [dict(persistence_threshold=0), dict()])
def test_sharded_gpt_in_reproducible_mode_equals_world_1_bitwise(knobs: dict) -> None:
    one_losses, one_params = run(1, gpt_run, knobs)[0]
    for world in (2, 3):
        for losses, params in run(world, gpt_run, knobs, timeout=120):
            assert losses == one_losses, world
            assert all(torch.equal(a, b) for a, b in zip(params, one_params)), world


def _mse(model: torch.nn.Module, rows: tuple) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(rows[0]), rows[1])


def hybrid_run(replicas: object) -> tuple:
    """test_hybrid's model (rank 0's initial values on every rank) and SGD, clipped at 0.05, in
    reproducible mode with 4 units of 2 rows per step: the full state and the norms."""
    from parts.partition import attach, backward_units, clip_grad_norm_, full_state_dict, partitioned, shards
    torch.manual_seed(100 + dist.get_rank())
    with partitioned(**(_layout(replicas) if dist.get_world_size() > 1 else {})):
        model = _model()
    attach(model, persistence_threshold=100, reproducible=True)
    opt = torch.optim.SGD(shards(model), lr=LR)
    norms = []
    for x, y in _batches(3, 8):
        backward_units(model, (x, y), 4, _mse)
        norms.append(float(clip_grad_norm_(model, 0.05)))
        opt.step()
        opt.zero_grad()
    return full_state_dict(model, rank0_only=False), norms


def test_hybrid_layouts_in_reproducible_mode_equal_full_sharding_and_world_1_bitwise() -> None:
    state, norms = run(1, hybrid_run, None)[0]
    for replicas in (None, 2, 4, "groups"):  # full sharding, 2 x 2, 4 x 1, 2 x 2 by explicit groups
        for other_state, other_norms in run(4, hybrid_run, replicas, timeout=120):
            assert other_norms == norms, replicas
            assert all(torch.equal(other_state[k], v) for k, v in state.items()), replicas
