"""parts.comm: the group handle, and the collectives' results and byte counts against torch's."""

import pytest
import torch
import torch.distributed as dist

from harness import run
from parts.comm import (GroupInfo, ReduceOp, WeakGroup, all_gather, all_reduce, comm_counter, group_info,
                        reduce_scatter, resolve_group, wire_bytes)


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


class _Group:
    """Stands for a process group (weakly referenceable, as torch's are)."""


class _Holder:
    group = WeakGroup()


def test_weak_group_does_not_keep_the_group_alive_and_names_itself_once_gone():
    holder, group = _Holder(), _Group()
    holder.group = group
    assert holder.group is group
    del group  # what destroy_process_group does to torch's own reference
    with pytest.raises(RuntimeError, match="_Holder.group: its process group was destroyed"):
        _ = holder.group
    holder.group = None  # None (the default group) stays None
    assert holder.group is None and _Holder().group is None
    info, kept = GroupInfo(_Group(), 1, 2), _Group()
    with pytest.raises(RuntimeError, match="GroupInfo.group"):
        _ = info.group
    assert GroupInfo(kept, 1, 2) == GroupInfo(kept, 1, 2) and GroupInfo().world_size == 1


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


def body_packed(sizes, async_op):
    """all_gather_many / reduce_scatter_many of mixed sizes equal the per-tensor collectives
    bitwise, count the same bytes, and issue one backend collective for the small ones."""
    from parts.comm import all_gather_many, reduce_scatter_many
    from parts.comm import gloo
    info, rank, world = group_info(None), dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    shards = [torch.randn(n, generator=gen) for n in sizes]
    fulls = [torch.randn(world * n, generator=gen) for n in sizes]
    calls = {"n": 0}
    real_ag, real_rs = gloo.all_gather_direct, gloo.reduce_scatter_consuming
    import parts.comm.collectives as coll

    def count(real):
        def wrapped(*args, **kwargs):
            calls["n"] += 1
            return real(*args, **kwargs)
        return wrapped

    coll.all_gather_direct, coll.reduce_scatter_consuming = count(real_ag), count(real_rs)
    try:
        before = comm_counter.snapshot()
        outs = [torch.empty(world * n) for n in sizes]
        work = all_gather_many(outs, shards, info, async_op=async_op)
        if work is not None:
            work.wait()
        gather_calls, calls["n"] = calls["n"], 0
        parts_ = [torch.empty(n) for n in sizes]
        work = reduce_scatter_many(parts_, [f.clone() for f in fulls], info, async_op=async_op, average=True)
        if work is not None:
            work.wait()
        rs_calls = calls["n"]
        counted = {k: _delta(before, k) for k in ("allgather_bytes", "allgather_calls", "reduce_scatter_bytes")}
    finally:
        coll.all_gather_direct, coll.reduce_scatter_consuming = real_ag, real_rs
    gather_ok, rs_ok = [], []
    for n, shard, out, full, part in zip(sizes, shards, outs, fulls, parts_):
        one = torch.empty(world * n)
        all_gather(one, shard, info, direct=True)
        gather_ok.append(torch.equal(one, out))
        mine = torch.empty(n)
        reduce_scatter(mine, full.clone(), info, consume=True, average=True)
        rs_ok.append(torch.equal(mine, part))
    return gather_ok, rs_ok, gather_calls, rs_calls, counted


@pytest.mark.parametrize("world, async_op", [(2, False), (3, True)])
def test_small_tensors_move_in_one_packed_collective(world, async_op):
    sizes = [5, 1, 300_000, 7, 0, 64]  # four small (packed), one large and one empty (direct)
    for gather_ok, rs_ok, gather_calls, rs_calls, counted in run(world, body_packed, sizes, async_op):
        assert all(gather_ok) and all(rs_ok)  # bitwise equal to one collective per tensor
        assert gather_calls == 3 and rs_calls == 3  # packed + the large one + the empty one
        assert counted["allgather_calls"] == 1
        assert counted["allgather_bytes"] == (world - 1) * 4 * sum(sizes)
        assert counted["reduce_scatter_bytes"] == (world - 1) * 4 * sum(sizes)
