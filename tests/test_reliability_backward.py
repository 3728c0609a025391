"""A second backward through a retained graph, and a gradient penalty
(``autograd.grad(create_graph=True)`` then ``backward``), on parameters the coordinator releases
after use (above the persistence threshold, ``max_reuse_distance=0`` too): the grad shards equal
plain torch's averaged per-rank grads (what DDP computes) at world 2 and 3.

Tolerance: fp32, rtol 1e-5 / atol 1e-6: the sharded run averages the ranks' grads in a
reduce-scatter, the reference in a Python sum, so the last bits may differ.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from harness import run

FAST = 60.0  # seconds: a regression that hangs fails here instead of stalling the suite
ROWS = 3  # batch rows per rank


def mlp() -> torch.nn.Module:
    """A seeded MLP whose second derivative is not zero (tanh), every param above threshold 0."""
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5),
                               torch.nn.Tanh(), torch.nn.Linear(5, 1))


def batch(rank: int) -> torch.Tensor:
    """Rank ``rank``'s inputs (different on every rank)."""
    return torch.randn(ROWS, 7, generator=torch.Generator().manual_seed(100 + rank))


def twice(model: torch.nn.Module, x: torch.Tensor) -> None:
    """Two backwards through one retained graph (grads accumulate: 2x)."""
    loss = model(x).pow(2).mean()
    loss.backward(retain_graph=True)
    loss.backward()


def penalty(model: torch.nn.Module, x: torch.Tensor) -> None:
    """Loss plus the squared norm of its grads w.r.t. the weights (a gradient penalty)."""
    loss = model(x).pow(2).mean()
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    grads = torch.autograd.grad(loss, weights, create_graph=True)
    (loss + sum(g.pow(2).sum() for g in grads)).backward()


CASES = {"twice": twice, "penalty": penalty}


def sharded_vs_plain(case: str, knobs: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(grad shard, the same slice of plain torch's rank-averaged grad) for every param."""
    from parts.partition import attach, meta, partition_module
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=20))  # fail fast
    reference = mlp()
    model = partition_module(copy.deepcopy(reference), group=group)
    attach(model, group=group, **knobs)
    for r in range(world):  # what DDP computes: the mean of every rank's grads
        CASES[case](reference, batch(r))
    CASES[case](model, batch(rank))
    from parts.partition import ParamStatus
    held = [n for n, q in model.named_parameters() if meta(q).status is not ParamStatus.NOT_AVAILABLE]
    assert not held, f"still gathered after the step: {held}"  # the penalty's holds are dropped
    pairs = []
    for p, q in zip(reference.parameters(), model.parameters()):
        start, stop = meta(q).layout.range(rank)
        want = p.grad.reshape(-1)[start:stop] / world
        pairs.append((meta(q).grad_shard[:stop - start].clone(), want.clone()))
    return pairs


KNOBS = {"released after use": dict(persistence_threshold=0),
         "max_reuse_distance=0": dict(persistence_threshold=0, max_reuse_distance=0, prefetch_bucket_size=0),
         "prefetching, reuse off": dict(persistence_threshold=0, max_reuse_distance=0)}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("knobs", sorted(KNOBS))
@pytest.mark.parametrize("world", [2, 3])
def test_second_backward_and_gradient_penalty_equal_plain_torch(case: str, knobs: str, world: int) -> None:
    """The second pass gathers the released weights again, and ``autograd.grad`` w.r.t. a
    released weight gets its grad: both equal plain torch."""
    for rank_pairs in run(world, sharded_vs_plain, case, KNOBS[knobs], timeout=FAST):
        for got, want in rank_pairs:
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
