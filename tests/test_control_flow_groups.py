"""Ranks that take other paths through training: replicas of a hybrid layout that accumulate
other numbers of micro-batches under ``no_sync`` (as DDP allows: only the synced backwards
pair up, and nothing inside ``no_sync`` crosses replicas), and a model sharded over part of
the world beside a rank that builds nothing (it blocks no one; a layout mismatch within the
part still raises on each of its ranks)."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from torch import nn

from harness import run


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def _batch(rank: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``k``-th micro-batch (3 rows)."""
    g = torch.Generator().manual_seed(1000 * rank + k)
    return (torch.randn(3, 8, generator=g, dtype=torch.float64),
            torch.randn(3, 2, generator=g, dtype=torch.float64))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y, reduction="sum")


@contextlib.contextmanager
def _float64():
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


def _reference(micro: dict[int, int]) -> dict:
    """One process: the sum of the grads over every rank's micro-batches (``micro``: rank -> count)."""
    torch.manual_seed(5)
    with _float64():
        model = _model()
    for rank, count in micro.items():
        for k in range(count):
            _loss(model, *_batch(rank, k)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


class _Collectives:
    """Wraps torch.distributed's collectives: the global ranks of each one's group, in call order."""

    names = ("all_reduce", "broadcast", "all_gather", "all_to_all_single", "isend", "irecv",
             "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
             "reduce_scatter_single", "barrier")

    def __init__(self) -> None:
        import torch.distributed as dist

        import parts._compat as compat
        self.seen: list[tuple[str, tuple[int, ...]]] = []
        self.undo = []
        for owner, names in ((dist, self.names), (compat, ("_ALL_GATHER", "_REDUCE_SCATTER"))):
            for name in names:
                if hasattr(owner, name):
                    original = getattr(owner, name)
                    self.undo.append((owner, name, original))
                    setattr(owner, name, self._wrap(name, original))

    def _wrap(self, name: str, original):
        import torch.distributed as dist

        def wrapped(*args, **kwargs):
            group = kwargs.get("group") or dist.group.WORLD
            self.seen.append((name, tuple(dist.get_process_group_ranks(group))))
            return original(*args, **kwargs)
        return wrapped

    def restore(self) -> None:
        for owner, name, original in self.undo:
            setattr(owner, name, original)


def _accumulate_unevenly(micro_per_replica: tuple[int, ...], freeze_on: int = -1) -> tuple[dict, list]:
    """A (replicate, shard) mesh; replica r runs ``micro_per_replica[r]`` micro-batches, all but
    the last under no_sync (rank ``freeze_on`` freezes the first weight before its last one):
    the full grads summed over every rank's micro-batches (one SGD step of lr 1), and the groups
    of the collectives issued inside no_sync."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from parts.partition import attach, full_state_dict, no_sync, partitioned, shards
    rank, world = dist.get_rank(), dist.get_world_size()
    per_replica = world // len(micro_per_replica)
    mesh = init_device_mesh("cpu", (len(micro_per_replica), per_replica), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(5)
    torch.set_default_dtype(torch.float64)  # the harness resets it
    with partitioned(mesh=mesh):
        model = _model()
    attach(model)
    before = full_state_dict(model, rank0_only=False)
    micro, inside = micro_per_replica[rank // per_replica], []
    for k in range(micro):
        loss = world * _loss(model, *_batch(rank, k))  # the grads are means over the ranks
        if k < micro - 1:
            wrapper = _Collectives()
            try:
                with no_sync(model):
                    loss.backward()
            finally:
                wrapper.restore()
            inside += wrapper.seen
        else:
            model[0].weight.requires_grad_(rank != freeze_on)
            loss.backward()
    torch.optim.SGD(shards(model), lr=1.0).step()
    after = full_state_dict(model, rank0_only=False)
    return {n: before[n] - after[n] for n in before}, inside


@pytest.mark.parametrize("world,micro", [(4, (3, 2)), (2, (3, 2)), (3, (1, 3, 2))])
def test_replicas_running_other_numbers_of_micro_batches_under_no_sync_sum_every_grad(world, micro):
    """At world 4, 2 replicas of 2 shards; at worlds 2 and 3, replicas of one rank each."""
    per_replica = world // len(micro)
    ref = _reference({rank: micro[rank // per_replica] for rank in range(world)})
    for rank, (grads, inside) in enumerate(run(world, _accumulate_unevenly, micro, timeout=30.0)):
        for name, g in ref.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-12, atol=1e-12)
        replica = set(range(rank // per_replica * per_replica, (rank // per_replica + 1) * per_replica))
        assert [(name, ranks) for name, ranks in inside if not set(ranks) <= replica] == []
        assert bool(inside) == (per_replica > 1)  # the wrapper sees the shard group's collectives


def test_requires_grad_set_otherwise_on_one_replica_raises_at_the_synced_backward_on_every_rank():
    from harness import RankFailure
    with pytest.raises(RankFailure) as failed:
        run(4, _accumulate_unevenly, (3, 2), 3, timeout=30.0)
    message = str(failed.value)
    assert "requires_grad of parameter '0.weight' differs across ranks" in message, message
    assert "True on global ranks [0, 1, 2], False on [3]" in message, message


def _build_on_part(case: str) -> tuple[str, object, float]:
    """World 3: ranks 0 and 1 shard a model over the group [0, 1] and train it 2 SGD steps, rank
    2 builds nothing and returns (``case`` "mismatch": rank 1 shards alone, replicated over [0, 1]).
    The outcome (error type and message, or "" and the full state) and the seconds."""
    import torch.distributed as dist

    from parts.partition import attach, full_state_dict, partitioned, shards
    start, rank = time.monotonic(), dist.get_rank()
    part, singles = dist.new_group([0, 1]), [dist.new_group([r]) for r in range(3)]  # every rank makes every group
    if rank == 2:
        return "", "", 0.0
    layout = {"group": singles[1], "replicate_group": part} if case == "mismatch" and rank == 1 else {"group": part}
    torch.manual_seed(5)
    torch.set_default_dtype(torch.float64)
    try:
        with partitioned(**layout):
            model = _model()
    except Exception as err:  # noqa: BLE001 - the outcome is what the test checks
        return type(err).__name__, str(err), time.monotonic() - start
    attach(model)
    opt = torch.optim.SGD(shards(model), lr=0.1)
    for k in range(2):
        (2 * _loss(model, *_batch(rank, k))).backward()
        opt.step()
        opt.zero_grad()
    return "", full_state_dict(model, rank0_only=False), time.monotonic() - start


def _train_on_two() -> dict:
    """One process: the 2 SGD steps of ``_build_on_part`` on the sum of ranks 0 and 1's losses."""
    torch.manual_seed(5)
    with _float64():
        model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for k in range(2):
        sum(_loss(model, *_batch(rank, k)) for rank in (0, 1)).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def test_a_model_on_part_of_the_world_trains_while_a_rank_outside_builds_nothing():
    ref = _train_on_two()
    out = run(3, _build_on_part, "train", timeout=30.0)
    assert out[2] == ("", "", 0.0)
    for kind, state, seconds in out[:2]:
        assert kind == "" and seconds < 10, (kind, state, seconds)
        for name, value in ref.items():
            torch.testing.assert_close(state[name], value, rtol=1e-12, atol=1e-12)


def test_a_layout_mismatch_within_the_part_raises_on_each_of_its_ranks_while_a_rank_outside_builds_nothing():
    out = run(3, _build_on_part, "mismatch", timeout=30.0)
    assert out[2] == ("", "", 0.0)
    for kind, message, _ in out[:2]:
        assert kind == "ValueError" and "disagree on the layout" in message, message
        assert "global rank 0 shards over global ranks [0, 1], replicated over none, global rank 1 shards " \
               "over global ranks [1], replicated over [0, 1]" in message, message
