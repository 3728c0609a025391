"""Ranks that disagree (a compression policy, a secondary group, a knob, a mesh of another
shape) or give bad input on one rank: every rank raises, naming the option and the ranks,
before the first collective they would issue apart: at ``attach`` for its options, at the
build (``partitioned``) for the layout. None hangs, none trains on silently. Worlds 3 and 2.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import RankFailure, run


class Net(nn.Module):
    """Two linears and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.down = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(torch.relu(self.up(x))))


def _attach_outcome(odd_rank: int, case: str) -> tuple[str, str]:
    """Build a Net on every rank and attach it, rank ``odd_rank`` passing something else
    (``case``); the exception each rank got (type, message), or ("", "") if attach passed."""
    from parts.partition import Compression, attach, partitioned
    torch.manual_seed(0)
    odd = dist.get_rank() == odd_rank
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes every group
    with partitioned():
        model = Net()
    knobs: dict = {}
    if case == "compression":
        knobs["compression"] = Compression(grads="int8") if odd else None
    elif case == "secondary_group":
        knobs["secondary_group"] = None if odd else singles[dist.get_rank()]
    elif case == "persistence_threshold":
        knobs["persistence_threshold"] = 0 if odd else 100_000
    elif case == "bad_compression":
        knobs["compression"] = "int8" if odd else None
    elif case == "unsharded" and odd:
        model.extra = nn.Linear(2, 2)  # added after the build: not sharded on this rank
    try:
        attach(model, **knobs)
    except Exception as err:  # noqa: BLE001 - the outcome is what the test checks
        return type(err).__name__, str(err)
    model(torch.ones(2, 8)).sum().backward()  # (never reached when a check works)
    return "", ""


DISAGREE = ["compression", "secondary_group", "persistence_threshold"]


@pytest.mark.parametrize("world,odd_rank", [(3, 2), (2, 0)])
@pytest.mark.parametrize("case", DISAGREE)
def test_ranks_that_disagree_at_attach_all_raise_naming_the_option_and_ranks(world, odd_rank, case):
    outcomes = run(world, _attach_outcome, odd_rank, case, timeout=30.0)
    others = ", ".join(str(r) for r in range(world) if r != odd_rank)
    for kind, message in outcomes:
        assert kind == "ValueError", outcomes
        assert f"disagree on {case}" in message and f"global rank {odd_rank}:" in message, message
        assert f"global rank{'s' if world == 3 else ''} {others}:" in message, message
    assert len({message for _, message in outcomes}) == 1  # the same words on every rank


@pytest.mark.parametrize("world,odd_rank", [(3, 1), (2, 1)])
@pytest.mark.parametrize("case,kind,names", [
    ("bad_compression", "TypeError", "compression takes a parts.partition.Compression"),
    ("unsharded", "ValueError", "parameter 'extra.weight'")])
def test_bad_input_on_one_rank_raises_there_and_names_that_rank_elsewhere(world, odd_rank, case, kind, names):
    outcomes = run(world, _attach_outcome, odd_rank, case, timeout=30.0)
    for rank, (got, message) in enumerate(outcomes):
        assert names in message, message
        if rank == odd_rank:
            assert got == kind
        else:
            assert got == "RankDisagreement" and f"rank {odd_rank}: {kind}" in message, message


def _mesh_outcome(odd_rank: int) -> tuple[str, str]:
    """Every rank makes both meshes of the world, (3, 1) and (1, 3) as (replicate, shard); rank
    ``odd_rank`` builds on the first, the others on the second (on meta: the build shares no
    values), then each attaches."""
    from torch.distributed.device_mesh import init_device_mesh

    from parts.partition import attach, partitioned
    world = dist.get_world_size()
    meshes = [init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
              for shape in ((world, 1), (1, world))]
    with partitioned(mesh=meshes[0 if dist.get_rank() == odd_rank else 1], device="meta"):
        model = Net()
    try:
        attach(model)
    except Exception as err:  # noqa: BLE001 - the outcome is what the test checks
        return type(err).__name__, str(err)
    return "", ""


@pytest.mark.parametrize("world,odd_rank", [(3, 0), (2, 1)])
def test_a_mesh_of_another_shape_on_one_rank_is_refused_on_every_rank(world, odd_rank):
    outcomes = run(world, _mesh_outcome, odd_rank, timeout=30.0)
    for kind, message in outcomes:
        assert kind == "ValueError", outcomes
        assert "disagree on the layout" in message and "mesh=" in message, message
        assert f"global rank {odd_rank} shards over global ranks [{odd_rank}]" in message, message


def _build_outcome(odd_rank: int, case: str) -> tuple[str, str]:
    """Build a Net with real values, rank ``odd_rank`` on another layout (``case`` "mesh": the
    (world, 1) mesh where the others take (1, world); "overlap": a replicate group sharing
    more than itself with the shard group, bad input); the exception each rank got."""
    from torch.distributed.device_mesh import init_device_mesh

    from parts.partition import partitioned
    world, odd = dist.get_world_size(), dist.get_rank() == odd_rank
    meshes = [init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
              for shape in ((world, 1), (1, world))]
    everyone = dist.new_group(list(range(world)))
    if case == "mesh":
        layout = {"mesh": meshes[0 if odd else 1]}
    else:
        layout = {"group": everyone, "replicate_group": everyone} if odd else {}
    try:
        with partitioned(**layout):
            Net()
    except Exception as err:  # noqa: BLE001 - the outcome is what the test checks
        return type(err).__name__, str(err)
    return "", ""


@pytest.mark.parametrize("world,odd_rank", [(3, 0), (3, 2), (2, 1)])
def test_a_build_on_another_mesh_on_one_rank_is_refused_on_every_rank(world, odd_rank):
    outcomes = run(world, _build_outcome, odd_rank, "mesh", timeout=30.0)
    for kind, message in outcomes:
        assert kind == "ValueError", outcomes
        assert "parts.partition: the ranks disagree on the layout" in message, message
        assert f"shards over global ranks [{odd_rank}], replicated over {list(range(world))}" in message


@pytest.mark.parametrize("world", [3, 2])
def test_a_bad_replicate_group_on_one_rank_is_refused_on_every_rank(world):
    outcomes = run(world, _build_outcome, 1, "overlap", timeout=30.0)
    for rank, (kind, message) in enumerate(outcomes):
        assert "replicate group" in message and "must share exactly this rank" in message, message
        assert kind == ("ValueError" if rank == 1 else "RankDisagreement"), outcomes
        if rank != 1:
            assert "rank 1: ValueError" in message


def _irregular_outcome() -> tuple[str, str]:
    """World 3 on explicit groups that make no (replicate, shard) grid: ranks 0 and 1 shard
    together, rank 2 alone, and rank 0 (not rank 1) is replicated with rank 2."""
    from parts.partition import partitioned
    pair, alone, across = dist.new_group([0, 1]), dist.new_group([2]), dist.new_group([0, 2])
    rank = dist.get_rank()
    layout = {"group": pair if rank < 2 else alone, "replicate_group": across if rank != 1 else None}
    try:
        with partitioned(**layout):
            Net()
    except Exception as err:  # noqa: BLE001 - the outcome is what the test checks
        return type(err).__name__, str(err)
    return "", ""


def test_groups_that_make_no_grid_are_refused_on_every_rank():
    for kind, message in run(3, _irregular_outcome, timeout=30.0):
        assert kind == "ValueError" and "disagree on the layout" in message, message


def _part_and_whole_outcome() -> tuple[str, str]:
    """The lower ranks shard over a group of part of the world, the last rank over the whole world
    (its wait for the others' build, the default store's timeout, set to 2 s here)."""
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _get_default_store

    from parts.partition import partitioned
    world, last = dist.get_world_size(), dist.get_rank() == dist.get_world_size() - 1
    part = dist.new_group(list(range(world - 1)), timeout=timedelta(seconds=20))  # every rank makes every group
    if last:
        _get_default_store().set_timeout(timedelta(seconds=2))  # this pool's store: the test ends it
    with partitioned(group=None if last else part):
        Net()
    return "", ""


@pytest.mark.parametrize("world", [3, 2])
def test_a_layout_over_all_of_the_world_beside_builds_over_part_of_it_raises_naming_the_ranks(world):
    """The ranks over part of the world build (they cannot tell this from a later build over the
    world); the rank over all of it raises once the store's timeout passed, naming them."""
    with pytest.raises(RankFailure) as failed:
        run(world, _part_and_whole_outcome, timeout=30.0)
    message = str(failed.value)
    assert failed.value.rank == world - 1 and "TimeoutError" in message, message
    assert f"for global ranks {list(range(world - 1))}, named by its layout" in message, message
    assert f"global rank 0: shards over global ranks {list(range(world - 1))}" in message, message


def _freeze_outcome(odd_rank: int, name: str, threshold: int) -> tuple[str, str]:
    """A step on every rank, then rank ``odd_rank`` alone freezes parameter ``name`` and all step again."""
    from parts.partition import attach, partitioned, shards
    torch.manual_seed(0)
    with partitioned():
        model = Net()
    attach(model, persistence_threshold=threshold)
    optimizer = torch.optim.SGD(shards(model), lr=0.1)
    try:
        for step in range(2):
            if step == 1 and dist.get_rank() == odd_rank:
                model.get_parameter(name).requires_grad_(False)
            model(torch.ones(2, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    except Exception as err:  # noqa: BLE001 - the outcome is what the test checks
        return type(err).__name__, str(err)
    return "", ""


@pytest.mark.parametrize("world,odd_rank,name,threshold",
                         [(3, 2, "norm.weight", 100_000), (2, 0, "norm.weight", 100_000), (2, 1, "up.weight", 0)])
def test_requires_grad_set_otherwise_on_one_rank_is_named_on_every_rank(world, odd_rank, name, threshold):
    """Before: gloo 'EnforceNotMet ... size mismatch' in the flat reduce-scatter (default knobs), no parameter named."""
    for kind, message in run(world, _freeze_outcome, odd_rank, name, threshold, timeout=30.0):
        assert kind in ("ValueError", "RuntimeError") and f"requires_grad of parameter '{name}'" in message, message
        assert f"False on [{odd_rank}]" in message, message
