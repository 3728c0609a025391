"""No hang: diverging ranks raise on every rank (debug mode); a dead rank fails the others.

Divergence: with ``FetchCoordinator(debug=True)`` every rank catches the ``RankDivergence``
and returns its message, so the test sees that *each* rank raised (none hung) and that the
message names the first divergent module. Death: a worker SIGKILLs itself at the moment it
should enter a gather / reduce-scatter / optimizer all-gather; the parts API runs over a
subgroup made with a short timeout, so the survivor's collective fails fast. The harness
then reports both: the dead rank ("died") and the survivor's traceback ("raised"), never
"did not finish" (the survivor blocked until it was killed).
"""

from __future__ import annotations

import importlib
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from harness import RankFailure, run
from torch import nn

from parts.partition import (FetchCoordinator, attach, gather, partition_module, reduce_scatter_grads,
                             release, shards)
from parts.partition.coordinator import RankDivergence

gather_mod = importlib.import_module("parts.partition.core.gather")  # (the package rebinds `gather`)
grads_mod = importlib.import_module("parts.partition.core.grads")

SHORT = timedelta(seconds=2)  # collective timeout of the subgroup the parts API runs over
WIDTH = 8


class Tower(nn.Module):
    """A stem, ``n`` blocks (any of which a rank may skip) and a head."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(n))
        self.head = nn.Linear(WIDTH, 1)
        self.skip: set = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.stem(x))
        for i, block in enumerate(self.blocks):
            if i not in self.skip:
                x = torch.tanh(block(x))
        return self.head(x).sum()


def _model(group=None) -> Tower:
    torch.manual_seed(0)
    return partition_module(Tower(), group=group)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))


# ----------------------------------------------------------------------------- divergence
def _diverge(scenario: str):
    """Run ``scenario`` under debug mode; return this rank's RankDivergence message (or None)."""
    rank = dist.get_rank()
    model = _model()
    attach(model, debug=True, persistence_threshold=0)
    try:
        for step in range(3):
            if scenario == "skip-block" and step == 1 and rank == 1:
                model.skip = {2}  # rank 1 skips block 2 in the second step
            if scenario == "extra-micro-batch" and step == 1 and rank == 1:
                model(_batch(99))  # rank 1 accumulates one more micro-batch before backward
            if scenario == "fewer-steps" and step == 2 and rank == 1:
                with torch.no_grad():
                    model(_batch(step))  # rank 1 stops training and evaluates instead
                return None
            model(_batch(step)).backward()
    except RankDivergence as error:
        return str(error)
    return None


@pytest.mark.parametrize("scenario, first", [
    ("skip-block", ["rank 0 is at the forward of module 'blocks.2'",
                    "rank 1 is at the forward of module 'blocks.3'"]),
    ("extra-micro-batch", ["rank 1 is at the forward of module '<root>'"]),
    ("fewer-steps", ["ranks diverged at event 0", "rank 1 is at"]),
])
def test_diverging_ranks_raise_on_every_rank(scenario: str, first: list) -> None:
    start = time.monotonic()
    messages = run(2, _diverge, scenario, timeout=30)
    assert time.monotonic() - start < 30
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} did not detect the divergence ({scenario})"
        assert "ranks diverged at event" in message
        for fragment in first:
            assert fragment in message, f"rank {rank}: {message}"
    assert messages[0] == messages[1]  # both ranks name the same first divergence


# ------------------------------------------------------------------------------ dead rank
def _die_on_call(module, name: str, call_no: int):
    """Make this process SIGKILL itself on the ``call_no``-th call of ``module.name``."""
    original, calls = getattr(module, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call_no:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(module, name, wrapper)


def _short_group():
    return dist.new_group(ranks=list(range(dist.get_world_size())), timeout=SHORT)


def _dies_in_gather(victim: int):
    group = _short_group()
    model = _model(group)
    if dist.get_rank() == victim:
        _die_on_call(gather_mod, "all_gather_many", 2)
    for step in range(3):
        gather(model.parameters())
        release(model.parameters())
    return "finished"


def _dies_in_reduce_scatter(victim: int):
    group = _short_group()
    model = _model(group)
    if dist.get_rank() == victim:
        _die_on_call(grads_mod, "reduce_scatter_many", 2)
    for step in range(3):
        gather(model.parameters())
        model(_batch(step)).backward()
        reduce_scatter_grads(model.parameters())
        release(model.parameters())
    return "finished"


def _dies_under_coordinator(victim: int):
    group = _short_group()
    model = _model(group)
    attach(model, FetchCoordinator(group=group, persistence_threshold=0))
    optimizer = torch.optim.AdamW(shards(model), lr=1e-2)
    if dist.get_rank() == victim:
        _die_on_call(gather_mod, "all_gather_many", 9)  # in the middle of the second step
    for step in range(3):
        model(_batch(step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return "finished"


def _dies_in_optimizer(victim: int):
    import parts.optim._collectives as optim_collectives
    from parts.optim import BF16Optimizer
    group = _short_group()
    torch.manual_seed(0)
    model = Tower().to(torch.bfloat16)
    optimizer = BF16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), group=group)
    if dist.get_rank() == victim:
        _die_on_call(optim_collectives, "gather_buckets", 2)
    for step in range(3):
        model(_batch(step).to(torch.bfloat16)).float().backward()
        optimizer.step()
        optimizer.zero_grad()
    return "finished"


def _in_collective(traceback: str) -> bool:
    """Whether a traceback ends in torch's collectives, parts.comm or a part's collectives module."""
    return any(where in traceback for where in ("distributed_c10d.py", "/parts/comm/", "_collectives.py"))


@pytest.mark.parametrize("body", [_dies_in_gather, _dies_in_reduce_scatter, _dies_under_coordinator,
                                  _dies_in_optimizer], ids=lambda f: f.__name__)
@pytest.mark.parametrize("victim", [1, 0])
def test_dead_rank_fails_the_survivor_fast(body, victim: int) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run(2, body, victim, timeout=45)
    elapsed = time.monotonic() - start
    message = str(info.value)
    survivor = 1 - victim
    assert f"rank {victim} of 2 died" in message
    assert "exit code -9" in message
    assert f"rank {survivor} of 2 raised" in message, message  # an error, not a hang
    assert "did not finish" not in message
    survivor_error = message.split(f"rank {survivor} of 2 raised", 1)[1]
    # it failed inside the collective it waited in (issued, or waited on, in the communication layer)
    assert _in_collective(survivor_error)
    assert any(word in survivor_error for word in ("Connection reset", "Connection closed", "Timed out")), \
        survivor_error[-600:]
    assert elapsed < 30, elapsed  # pool start-up (a few s) + the failure; the timeout was 45 s


def _stalls_in_gather(victim: int):
    group = _short_group()
    model = _model(group)
    if dist.get_rank() == victim:
        time.sleep(40)  # stuck (not dead): its sockets stay open, only the timeout can tell
    gather(model.parameters())
    return "finished"


def test_stuck_rank_times_the_survivor_out() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run(2, _stalls_in_gather, 1, timeout=45)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank 0 of 2 raised" in message, message
    survivor_error = message.split("rank 0 of 2 raised", 1)[1]
    in_collective = _in_collective(survivor_error)
    # gloo says "Timed out waiting ..." or, for a collective queued behind the one that timed
    # out, "Application timeout caused pair closure"
    timed_out = "Timed out" in survivor_error or "Application timeout" in survivor_error
    assert in_collective and timed_out, survivor_error[-600:]
    assert "ranks [1] did not finish" in message  # the stuck rank was stopped by the harness
    assert elapsed < 20, elapsed  # the 2 s group timeout fired, not the 45 s harness timeout
