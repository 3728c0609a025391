"""Reproducible mode's other norms: ``BF16Optimizer`` clipping by a norm over a grid
(``norm_groups``) and ``clip_grad_norm_(model, grid=...)`` give the same bits at world 1, 2 and 3
over one tp rank, and at dp 1 and 2 over two;
the combinations whose sums stay in float are refused with an error naming the part: grads
consumed by ``OffloadedOptimizer.step_in_backward`` under a clip, and parameters that
``BF16Optimizer`` shards itself beside a reproducible model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import run
from test_reproducible import UNITS, Net, _assert_equal, _batch, loss_fn

STEPS = 3


def grid_train(kind: str) -> dict:
    """``STEPS`` reproducible steps over a ``ParallelGrid(tp=1)`` (dp = world), clipped at 0.05 by the
    norm over the grid: ``BF16Optimizer(norm_groups=(tp_group,))`` or ``clip_grad_norm_(grid=)``."""
    from parts.optim import BF16Optimizer
    from parts.parallel import ParallelGrid
    from parts.partition import attach, full_state_dict, partitioned, shards
    grid = ParallelGrid(1)
    torch.manual_seed(0)
    with partitioned(group=grid.dp_group):
        model = Net()
    attach(model, group=grid.dp_group, reproducible=True)
    if kind == "bf16optimizer":
        opt = BF16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), group=grid.dp_group, clip_grad=0.05,
                            norm_groups=(grid.tp_group,), allow_fp32=True)
    else:
        opt = torch.optim.AdamW(shards(model), lr=1e-2)
    losses, norms = _clipped_steps(model, opt, kind, grid, _batch, UNITS, loss_fn)
    return {"weights": full_state_dict(model, rank0_only=False), "losses": losses, "norms": norms}


def _clipped_steps(model: torch.nn.Module, opt: object, kind: str, grid: object, batch_of: object, units: int,
                   loss: object) -> tuple[list, list]:
    """``STEPS`` steps of ``backward_units`` over the dp group, clipped at 0.05 by the norm over the grid
    (``clip_grad_norm_(grid=)`` for ``clip``, else inside ``BF16Optimizer``): the losses and the norms."""
    from parts.partition import backward_units, clip_grad_norm_
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(float(backward_units(model, batch_of(step), units, loss, group=grid.dp_group)))
        if kind == "clip":
            norms.append(float(clip_grad_norm_(model, 0.05, grid=grid)))
        opt.step()
        opt.zero_grad()
        if kind == "bf16optimizer":
            norms.append(opt.last_grad_norm)
    return losses, norms


@pytest.mark.parametrize("kind", ["bf16optimizer", "clip"])
def test_a_clip_norm_over_a_grid_gives_the_same_bits_at_world_1_2_and_3(kind: str) -> None:
    results = {world: run(world, grid_train, kind, timeout=120)[0] for world in (1, 2, 3)}
    assert all(n > 0.05 for n in results[1]["norms"])  # the clip scaled every step
    _assert_equal(results)


def consumed_then_clip(store: str) -> str:
    """A reproducible model with shards on disk stepped inside ``step_in_backward`` (one unit per rank,
    so its one backward is the last), then clipped."""
    from parts.offload import DiskStore, OffloadedOptimizer
    from parts.partition import attach, backward_units, clip_grad_norm_, partitioned, shards
    torch.manual_seed(0)
    with partitioned(remote_device=DiskStore(f"{store}-shards-{dist.get_rank()}")):
        model = Net()
    attach(model, reproducible=True)
    opt = OffloadedOptimizer(torch.optim.AdamW(shards(model), lr=1e-2), DiskStore(f"{store}-optim-{dist.get_rank()}"))
    with opt.step_in_backward():
        backward_units(model, _batch(0), dist.get_world_size(), loss_fn)
    try:
        clip_grad_norm_(model, 0.05)
    except RuntimeError as error:
        return str(error)
    finally:
        opt.step()
    return ""


def test_a_clip_of_grads_consumed_in_backward_is_refused_in_reproducible_mode(tmp_path: Path) -> None:
    for message in run(2, consumed_then_clip, str(tmp_path / "store"), timeout=120):
        assert "reproducible mode" in message and "step_in_backward" in message and "fixed point" in message


def self_sharded_beside() -> str:
    """``BF16Optimizer`` over a reproducible model's parameters and one built outside ``partitioned``."""
    from parts.optim import BF16Optimizer
    from parts.partition import attach, partitioned
    torch.manual_seed(0)
    with partitioned():
        model = Net()
    attach(model, reproducible=True)
    extra = torch.nn.Parameter(torch.zeros(3))
    try:
        BF16Optimizer(torch.optim.AdamW([*model.parameters(), extra], lr=1e-2), allow_fp32=True,
                      named_parameters=[*model.named_parameters(), ("extra.bias", extra)])
    except ValueError as error:
        return str(error)
    return ""


def test_bf16optimizer_refuses_parameters_it_would_average_in_float_beside_a_reproducible_model() -> None:
    for message in run(2, self_sharded_beside):
        assert "'extra.bias'" in message and "reproducible" in message and "partitioned()" in message


TP_SHAPE = dict(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)


def _tokens(step: int) -> tuple:
    """Step ``step``'s global batch of 8 sequences for the GPT of ``TP_SHAPE``: inputs and targets."""
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def tp_grid_train(kind: str) -> dict:
    """``STEPS`` reproducible steps of the 2-D recipe's tensor-parallel GPT over a ``ParallelGrid(tp=2)``
    (dp = world / 2), clipped at 0.05 by the norm over the grid, as in ``grid_train``; this rank's
    tp slices of the weights."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
    from gpt_model import GPTConfig
    from gpt_tp_model import TPGPT
    from parts.optim import BF16Optimizer
    from parts.parallel import ParallelGrid, tp_split
    from parts.partition import attach, full_state_dict, partitioned, register_external_parameter, shards
    grid = ParallelGrid(2)
    torch.manual_seed(0)
    with partitioned(group=grid.dp_group):
        model = TPGPT(GPTConfig(**TP_SHAPE), grid.tp_group, seed=0)
    attach(model, group=grid.dp_group, reproducible=True)
    register_external_parameter(model, model.wte.weight)  # the tied head runs in the root's forward
    if kind == "bf16optimizer":
        opt = BF16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), group=grid.dp_group, clip_grad=0.05,
                            norm_groups=(grid.tp_group,), replicated=lambda p: tp_split(p) is None,
                            allow_fp32=True)
    else:
        opt = torch.optim.AdamW(shards(model), lr=1e-2)
    losses, norms = _clipped_steps(model, opt, kind, grid, _tokens, 4, lambda m, b: m(*b))
    return {"weights": full_state_dict(model, rank0_only=False), "losses": losses, "norms": norms,
            "tp_rank": grid.tp_rank}


@pytest.mark.parametrize("kind", ["bf16optimizer", "clip"])
def test_a_clip_norm_over_a_grid_of_two_tp_ranks_gives_the_same_bits_at_dp_1_and_2(kind: str) -> None:
    by_tp_rank: dict[int, list[dict]] = {0: [], 1: []}
    for world in (2, 4):
        for result in run(world, tp_grid_train, kind, timeout=120):
            by_tp_rank[result["tp_rank"]].append(result)
    assert all(n > 0.05 for n in by_tp_rank[0][0]["norms"])  # the clip scaled every step
    assert not torch.equal(by_tp_rank[0][0]["weights"]["blocks.0.fc.weight"],
                           by_tp_rank[1][0]["weights"]["blocks.0.fc.weight"])  # two different tp slices
    for results in by_tp_rank.values():
        _assert_equal(dict(enumerate(results)))
