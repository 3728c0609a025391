"""An attached model dropped without ``detach`` does not disturb the models trained after it.

A dropped model's coordinator lives until a garbage collection, which runs at different
moments on different ranks. Here it is collected on one rank and kept on the others, with
gathered copies left stale by a write outside an optimizer step (what a hand-written weight
average does). The next model's optimizer steps must not make the survivors refresh the
dropped model (a collective only some ranks would issue): the next model trains as if alone,
bitwise. Several models attached at once each refresh after the steps of their own shards.
"""

import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run


class Net(nn.Module):
    """Two linears and a norm, every parameter small enough to stay gathered between steps."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(8, width)
        self.norm = nn.LayerNorm(width)
        self.down = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(torch.relu(self.up(x))))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, first: int = 0) -> list[float]:
    """Losses of ``steps`` iterations of forward, backward, step on this rank's batches."""
    losses = []
    for step in range(first, first + steps):
        loss = model(_batch(step, dist.get_rank())).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _model_b(width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from parts.partition import attach, partitioned, shards
    torch.manual_seed(1)
    with partitioned():
        model = Net(width)
    attach(model, persistence_threshold=10_000)
    return model, torch.optim.AdamW(shards(model), lr=1e-2)


def _b_after_dropped_a(drop_rank: int, width: int) -> list[float]:
    """Model A trained, its gathered copies made stale, dropped (collected on ``drop_rank``
    only, held elsewhere); then model B trained: B's losses."""
    from parts.partition import attach, partitioned, shards
    torch.manual_seed(0)
    with partitioned():
        model = Net()
    attach(model, persistence_threshold=10_000)
    opt = torch.optim.AdamW(shards(model), lr=1e-2)
    _train(model, opt, 2)
    with torch.no_grad():  # written outside an optimizer step: the gathered copies are stale now
        torch._foreach_mul_(shards(model), 0.5)
    held = [model, opt] if dist.get_rank() != drop_rank else []
    del model, opt
    gc.collect()  # the drop rank's coordinator of A is gone; the others' lives on in `held`
    b, opt_b = _model_b(width)
    losses = _train(b, opt_b, 3)
    held.clear()
    return losses


def _b_alone(width: int) -> list[float]:
    b, opt_b = _model_b(width)
    return _train(b, opt_b, 3)


@pytest.mark.parametrize("world,drop_rank", [(2, 0), (3, 1)])
def test_a_model_dropped_on_one_rank_does_not_hang_the_next(world: int, drop_rank: int) -> None:
    alone = run(world, _b_alone, 24)
    after = run(world, _b_after_dropped_a, drop_rank, 24, timeout=30.0)
    assert after == alone


def _two_models() -> dict:
    """Models A and B attached at once: each with its optimizer, then one optimizer over both.
    A's gathered copies are made stale by a write outside a step before each B step; B's step
    gathers for B alone, ``refresh(a)`` for A; then every kept weight is read and compared with
    ``full_state_dict``."""
    from parts.comm import comm_counter
    from parts.partition import refresh, shards
    a, opt_a = _model_b(16)
    b, opt_b = _model_b(24)
    both = torch.optim.AdamW(shards(a) + shards(b), lr=1e-2)
    out = {"stale": [], "gathers": []}
    for step in range(4):
        pairs = ((a, opt_a), (b, opt_b)) if step < 2 else ((None, both),)
        for model, opt in pairs:
            for m in (a, b) if model is None else (model,):
                m(_batch(step, dist.get_rank())).square().mean().backward()
            if model is b:
                with torch.no_grad():
                    torch._foreach_mul_(shards(a), 0.5)
            before = comm_counter.allgather_calls
            opt.step()
            opt.zero_grad()
            out["gathers"].append(comm_counter.allgather_calls - before)
            if model is b:
                refresh(a)
        out["stale"] += _stale(a) + _stale(b)
    return out


def _stale(model: nn.Module) -> list[str]:
    """Names whose value in ``model.state_dict()`` differs from ``full_state_dict``'s."""
    from parts.partition import full_state_dict
    state = {k: v.clone() for k, v in model.state_dict().items()}
    full = full_state_dict(model, rank0_only=False)
    return [k for k in full if not torch.equal(state[k], full[k])]


@pytest.mark.parametrize("world", [2, 3])
def test_two_attached_models_each_refresh_after_their_own_step(world: int) -> None:
    for out in run(world, _two_models):
        assert out["stale"] == []
        assert out["gathers"] == [1, 1, 1, 1, 2, 2]  # A's, B's (none for A), both models'
