"""parts.comm: the group handle, and the collectives' results and byte counts against torch's."""

import pytest
import torch
import torch.distributed as dist

from harness import run
from parts.comm import (ReduceOp, all_gather, all_reduce, comm_counter, group_info, reduce_scatter,
                        resolve_group, wire_bytes)


def test_wire_bytes_convention():
    # (w - 1) chunks of c bytes: what one rank receives in an all-gather / sends in a reduce-scatter
    assert wire_bytes(100, 1) == 0
    assert wire_bytes(100, 2) == 100
    assert wire_bytes(12, 4) == 36


def test_not_distributed_is_a_world_of_one(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    info = resolve_group(None, "test")
    assert (info.group, info.rank, info.world_size, info.global_ranks()) == (None, 0, 1, [0])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="test: WORLD_SIZE=2"):
        resolve_group(None, "test")
    assert group_info(None).world_size == 1  # lenient: no launcher check


def _delta(before, key):
    return comm_counter.snapshot()[key] - before[key]


def body_counted_collectives(numel):
    """all_gather / reduce_scatter / all_reduce equal torch's and count (w-1) * chunk bytes."""
    info, rank, world = group_info(None), dist.get_rank(), dist.get_world_size()
    shard = torch.arange(numel, dtype=torch.float32) + 1000 * rank
    expected = [torch.empty(numel) for _ in range(world)]
    dist.all_gather(expected, shard)
    out = {}
    for direct in (False, True):
        got, before = torch.empty(world * numel), comm_counter.snapshot()
        all_gather(got, shard, info, direct=direct)
        out[f"gather_equal_{direct}"] = torch.equal(got, torch.cat(expected))
        out[f"gather_bytes_{direct}"] = _delta(before, "allgather_bytes")
        out[f"gather_calls_{direct}"] = _delta(before, "allgather_calls")
    full = torch.arange(world * numel, dtype=torch.float32) * (rank + 1)
    reference = full.clone()
    dist.all_reduce(reference)
    for consume in (False, True):
        got, before = torch.empty(numel), comm_counter.snapshot()
        reduce_scatter(got, full.clone(), info, consume=consume, average=True)
        mine = reference.view(world, numel)[rank] / world
        out[f"rs_equal_{consume}"] = torch.equal(got, mine)
        out[f"rs_bytes_{consume}"] = _delta(before, "reduce_scatter_bytes")
    t, before = torch.full((numel,), float(rank)), comm_counter.snapshot()
    all_reduce(t, info, ReduceOp.MAX)
    out["max_equal"] = torch.equal(t, torch.full((numel,), float(world - 1)))
    out["all_reduce_bytes"] = _delta(before, "all_reduce_bytes")
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_collectives_equal_torch_and_count_wire_bytes(world):
    numel = 6
    chunk = numel * 4
    for out in run(world, body_counted_collectives, numel):
        for flag in (False, True):
            assert out[f"gather_equal_{flag}"] and out[f"rs_equal_{flag}"]
            assert out[f"gather_bytes_{flag}"] == (world - 1) * chunk
            assert out[f"gather_calls_{flag}"] == 1
            assert out[f"rs_bytes_{flag}"] == (world - 1) * chunk
        assert out["max_equal"]
        assert out["all_reduce_bytes"] == 2 * (world - 1) * chunk // world  # 2(w-1)/w of the tensor


def body_non_member(what):
    """On a group of ranks 1.. only: rank 0 resolving it gets an error naming itself and ``what``."""
    rest = dist.new_group(list(range(1, dist.get_world_size())))
    try:
        info = resolve_group(rest, what)
    except ValueError as e:
        return str(e)
    return (info.rank, info.world_size, info.global_ranks(), info.global_rank(0))


def test_group_handle_on_a_sub_group():
    zero, one, two = run(3, body_non_member, "Thing(group=...)")
    assert "Thing(group=...): rank 0 is not a member" in zero
    assert one == (0, 2, [1, 2], 1) and two == (1, 2, [1, 2], 1)
