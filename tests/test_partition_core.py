"""parts.partition core: shard/gather/release, gathered, reduce_scatter_grads, shards (harness, world 1..4)."""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st
from torch import nn

from harness import run
from parts.partition.core.grad_guard import raw_grad
from parts.partition import (ParamStatus, StoragePool, comm_counter, gather, gathered, is_partitioned, meta,
                             partition_module, partitioned, reduce_scatter_grads, release, shards)
from parts.partition.core import param as param_mod

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DIMS = st.sampled_from([0, 1, 2, 3, 5, 7, 13, 31])
SHAPE = st.one_of(st.lists(DIMS, min_size=0, max_size=3).map(tuple),
                  st.sampled_from([(1031,), (97, 3), (4099,)]))
SPECS = st.lists(st.tuples(SHAPE, st.sampled_from(sorted(DTYPES))), min_size=1, max_size=5)


class Bag(nn.Module):
    """Parameters with the given (shape, dtype) specs, values from ``seed``."""

    def __init__(self, specs, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for i, (shape, dt) in enumerate(specs):
            value = torch.randn(shape, generator=g).to(DTYPES[dt])
            self.register_parameter(f"p{i}", nn.Parameter(value))


def _poison(numel, dtype, device):
    t = torch.empty(numel, dtype=dtype, device=device)
    return t.fill_(float("nan")) if dtype.is_floating_point else t.fill_(0x5A)


class poisoned:
    """Every fresh allocation of parts.partition is filled with NaN (floats) / 0x5A (bytes)."""

    def __enter__(self):
        self.saved, param_mod.allocator = param_mod.allocator, _poison

    def __exit__(self, *exc):
        param_mod.allocator = self.saved


# --------------------------------------------------------------------- shard/gather round trip
def body_roundtrip(specs, seed, poison):
    rank = dist.get_rank()
    with poisoned() if poison else contextlib.nullcontext():
        bag = partition_module(Bag(specs, seed + rank))  # every rank has other values
        ref = Bag(specs, seed)  # rank 0's values
        params = list(bag.parameters())
        out = {"shards": [], "flat": [], "padded": []}
        for p, r in zip(params, ref.parameters()):
            m = meta(p)
            assert p.data.numel() == 0 and p.untyped_storage().nbytes() == 0, m.name
            assert m.status is ParamStatus.NOT_AVAILABLE and m.shape == r.shape and m.numel == r.numel()
            assert m.shard.numel() == m.layout.shard_numel and m.shard.dtype == r.dtype
            start, stop = m.layout.range(rank)
            assert torch.equal(m.shard[stop - start:], torch.zeros_like(m.shard[stop - start:]))
            out["shards"].append(m.shard.clone())
            out["flat"].append(r.detach().reshape(-1).clone())
        before = comm_counter.allgather_calls
        gather(params)
        assert comm_counter.allgather_calls == before + 1  # one group of collectives
        for p, r in zip(params, ref.parameters()):
            assert meta(p).status is ParamStatus.AVAILABLE
            assert p.shape == r.shape and p.dtype == r.dtype and torch.equal(p.data, r.data), meta(p).name
        gather(params)
        assert comm_counter.allgather_calls == before + 1  # AVAILABLE: no communication
        _free_and_refill(params, list(ref.parameters()))
        release(params)
        for p in params:
            assert p.data.numel() == 0 and p.untyped_storage().nbytes() == 0
            assert meta(p).status is ParamStatus.NOT_AVAILABLE
    return out


def _free_and_refill(params, refs):
    """release(free_storage=True) empties the full storages; gather refills those same storages
    (fresh memory without a pool; with one, the very blocks the release gave it)."""
    for pool in (None, StoragePool()):
        fulls = [p.data for p in params]
        ptrs = [full.untyped_storage().data_ptr() for full in fulls]
        release(params, free_storage=True, pool=pool)
        for p, full in zip(params, fulls):
            assert p.data.numel() == 0 and full.untyped_storage().nbytes() == 0, meta(p).name
        if pool is not None:
            assert pool.cached_bytes == sum(_padded_nbytes(p) for p in params if meta(p).numel)
        gather(params, pool=pool)
        for p, r, full in zip(params, refs, fulls):
            if r.numel():  # the same storage, refilled with the gathered values
                assert p.data.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
            assert torch.equal(full, r.data) and torch.equal(p.data, r.data), meta(p).name
        if pool is not None:
            assert pool.cached_bytes == 0  # every block went back to a parameter of its size
            assert sorted(p.data.untyped_storage().data_ptr() for p in params if meta(p).numel) == \
                sorted(ptr for p, ptr in zip(params, ptrs) if meta(p).numel)


def _padded_nbytes(p):
    m = meta(p)
    return m.world_size * m.layout.shard_numel * m.dtype.itemsize


@settings(max_examples=25, deadline=None)
@given(world=st.integers(1, 4), specs=SPECS, seed=st.integers(0, 2**16), poison=st.booleans())
def test_shard_gather_roundtrip(world, specs, seed, poison):
    results = run(world, body_roundtrip, specs, seed, poison)
    for i in range(len(specs)):
        flat = results[0]["flat"][i]
        cat = torch.cat([r["shards"][i] for r in results])
        padded = torch.zeros_like(cat)
        padded[:flat.numel()] = flat
        assert torch.equal(cat, padded), (i, specs[i])  # concatenated shards == padded flat


# ------------------------------------------------------------- freed storage and autograd
def body_saved_views():
    """F.linear saves a view of the weight; freeing the storage frees it, re-gathering restores it."""
    torch.manual_seed(3)
    ref = nn.Linear(32, 16)
    torch.manual_seed(3)
    lin = partition_module(nn.Linear(32, 16))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(dist.get_rank()), requires_grad=True)
    ref(x).square().sum().backward()
    ref_x_grad, x.grad = x.grad, None
    gather(lin.parameters())
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = lin(x).square().sum()
    weight_view = next(t for t in saved if t.shape == (32, 16))  # weight.t()
    release(lin.parameters(), free_storage=True)
    assert weight_view.untyped_storage().nbytes() == 0  # the graph holds no full weight now
    with pytest.raises(RuntimeError, match="storage of size 0"):
        out.backward(retain_graph=True)  # never computes with a released weight
    gather(lin.parameters())
    out.backward()
    assert torch.equal(lin.weight.grad, ref.weight.grad) and torch.equal(lin.bias.grad, ref.bias.grad)
    assert torch.equal(x.grad, ref_x_grad)
    release(lin.parameters(), free_storage=True)
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_free_storage_keeps_saved_views_correct(world):
    assert run(world, body_saved_views) == [True] * world


# --------------------------------------------------------------------- reduce_scatter_grads
def _int_grads(specs, seed, step, rank):
    """Integer-valued grads: sums are exact in any order, so results compare with torch.equal."""
    g = torch.Generator().manual_seed(seed * 1000 + step * 10 + rank)
    return [torch.randint(-8, 9, shape, generator=g).to(DTYPES[dt]) for shape, dt in specs]


def body_reduce_scatter(specs, seed, steps, average, poison, async_op):
    rank, world = dist.get_rank(), dist.get_world_size()
    with poisoned() if poison else contextlib.nullcontext():
        bag = partition_module(Bag(specs, seed))
    params = list(bag.parameters())
    gather(params)  # grads are produced while params are full
    expected = [None] * len(params)
    for step in range(steps):
        grads = _int_grads(specs, seed, step, rank)
        for i, (p, g) in enumerate(zip(params, grads)):
            full = g.float().reshape(-1).clone()
            dist.all_reduce(full)  # reference: all-reduce, then slice
            if average and world > 1:
                full.div_(world)
            m = meta(p)
            start, stop = m.layout.range(rank)
            piece = torch.zeros(m.layout.shard_numel)
            piece[:stop - start] = full[start:stop]
            expected[i] = piece if expected[i] is None else expected[i] + piece
            p.grad = g.clone()
        before = comm_counter.reduce_scatter_calls
        with poisoned() if poison else contextlib.nullcontext():
            handle = reduce_scatter_grads(params, average=average, async_op=async_op)
        if async_op:  # the grads are packed and freed at once; the shards change on wait()
            assert all(raw_grad(p) is None for p in params)  # p.grad raises: the grad is in the shard
            handle.wait()
            handle.wait()  # idempotent
        assert comm_counter.reduce_scatter_calls == before + 1
        assert all(raw_grad(p) is None for p in params)  # p.grad raises: the grad is in the shard
    for p, e in zip(params, expected):
        gs = meta(p).grad_shard
        assert gs.dtype == torch.float32 and torch.equal(gs, e), (meta(p).name, gs, e)
    return True


@settings(max_examples=20, deadline=None)
@given(world=st.integers(1, 4), specs=SPECS, seed=st.integers(0, 2**10), steps=st.integers(1, 4),
       average=st.booleans(), poison=st.booleans(), async_op=st.booleans())
def test_reduce_scatter_equals_allreduce_then_slice(world, specs, seed, steps, average, poison, async_op):
    assert all(run(world, body_reduce_scatter, specs, seed, steps, average, poison, async_op))


def body_accumulate_false():
    bag = partition_module(Bag([((5, 3), "bf16")], 1))
    p = bag.p0
    gather([p])
    for value in (1.0, 2.0):
        p.grad = torch.full((5, 3), value, dtype=torch.bfloat16)
        reduce_scatter_grads([p], accumulate=False, average=False)
    n = meta(p).layout.range(dist.get_rank())
    real = meta(p).grad_shard[: n[1] - n[0]]
    return torch.equal(real, torch.full_like(real, 2.0 * dist.get_world_size()))


def test_reduce_scatter_overwrite_and_sum():
    assert all(run(3, body_accumulate_false))


# --------------------------------------------------------------------- async, idempotent fetch
def body_async():
    bag = partition_module(Bag([((7, 3), "fp32"), ((11,), "fp32"), ((), "bf16")], 3))
    ref = Bag([((7, 3), "fp32"), ((11,), "fp32"), ((), "bf16")], 3)
    a, b, c = bag.p0, bag.p1, bag.p2
    calls = comm_counter.allgather_calls
    h1 = gather([a, b], async_op=True)
    assert meta(a).status is ParamStatus.INFLIGHT and meta(b).status is ParamStatus.INFLIGHT
    h2 = gather([b, c], async_op=True)  # b joins h1, only c is requested
    assert comm_counter.allgather_calls == calls + 2
    h2.wait()
    assert all(meta(p).status is ParamStatus.AVAILABLE for p in (a, b, c))
    h1.wait()
    h2.wait()  # idempotent
    ok = all(torch.equal(p.data, r.data) for p, r in zip((a, b, c), ref.parameters()))
    h3 = gather([a], async_op=True)
    release([a, b, c])
    h3.wait()
    h4 = gather([a, b, c], async_op=True)
    release([a])  # waits the in-flight gather first
    assert meta(a).status is ParamStatus.NOT_AVAILABLE and a.data.numel() == 0
    h4.wait()
    return ok and torch.equal(b.data, ref.p1.data)


def test_async_gather_inflight_and_join():
    assert all(run(2, body_async))


# --------------------------------------------------------------------- gathered
def body_gathered():
    rank = dist.get_rank()
    bag = partition_module(Bag([((6, 5), "fp32"), ((3,), "bf16")], 0))
    ref = Bag([((6, 5), "fp32"), ((3,), "bf16")], 0)
    params = list(bag.parameters())
    with gathered(params):
        for p in params:
            p.data.fill_(rank + 7.0)
    with gathered(params):
        assert all(torch.equal(p.data, r.data) for p, r in zip(params, ref.parameters()))
    assert all(meta(p).status is ParamStatus.NOT_AVAILABLE for p in params)
    with gathered(params, modifier_rank=1):
        for p in params:
            p.data.fill_(rank + 1.0)
        with gathered(params):  # nested: already gathered params stay available
            params[0].data.fill_(-5.0)
        assert all(meta(p).status is ParamStatus.AVAILABLE for p in params)
        assert torch.equal(params[0].data, torch.full((6, 5), rank + 1.0))  # inner changes discarded
    assert all(meta(p).status is ParamStatus.NOT_AVAILABLE for p in params)
    gather(params)
    with gathered(params, modifier_rank=0):
        params[1].data.fill_(rank + 3.0)
    assert meta(params[1]).status is ParamStatus.AVAILABLE  # was available before
    return [p.data.clone() for p in params]


def test_gathered_modifier_nested_discard():
    out = run(3, body_gathered)
    for r in out:
        assert torch.equal(r[0], torch.full((6, 5), 2.0))  # rank 1's values
        assert torch.equal(r[1], torch.full((3,), 3.0, dtype=torch.bfloat16))  # rank 0's


# --------------------------------------------------------------------- shards + torch optimizer
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 7), nn.Linear(7, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def body_adamw(steps):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = Net()
    torch.manual_seed(0)
    net = partition_module(Net())
    opt = torch.optim.AdamW(shards(net), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(steps):
        xs = [torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(world)]
        with gathered(net.parameters()):
            net(xs[rank]).pow(2).sum().backward()
            reduce_scatter_grads(list(net.parameters()))
        opt.step()
        opt.zero_grad()
        sum(ref(x).pow(2).sum() for x in xs).div(world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with gathered(net.parameters()):
        # the order of the cross-rank sum differs from the local reference: fp32 rounding only
        return all(torch.allclose(p, r, rtol=0, atol=1e-6) for p, r in zip(net.parameters(), ref.parameters()))


def test_adamw_on_shards_matches_ddp_reference():
    assert all(run(2, body_adamw, 3))


def body_bf16_shards_refused():
    net = partition_module(Net(), dtype=torch.bfloat16)
    try:
        shards(net)
    except TypeError as e:
        return "BF16Optimizer" in str(e) and "a.weight" in str(e)
    return False


def test_shards_refuses_bf16_with_reason():
    assert all(run(1, body_bf16_shards_refused))


# --------------------------------------------------------------------- errors and guards
def body_forward_released():
    net = partition_module(Net())
    try:
        net(torch.randn(2, 5))
    except RuntimeError as e:
        return str(e)
    return ""


def test_forward_on_released_param_names_param_and_module():
    msg = run(2, body_forward_released)[0]
    assert "'a.weight'" in msg and "module 'a'" in msg and "Linear" in msg


def body_mixed_groups():
    other = dist.new_group([0, 1])
    x = partition_module(Bag([((4,), "fp32")], 0))
    y = partition_module(Bag([((4,), "fp32")], 0), group=other)
    try:
        gather([x.p0, y.p0])
    except ValueError as e:
        return "p0" in str(e) and "process groups" in str(e)
    return False


def test_mixed_groups_refused():
    assert all(run(2, body_mixed_groups))


def body_guard():
    old = os.environ["WORLD_SIZE"]
    os.environ["WORLD_SIZE"] = "4"
    try:
        with partitioned():
            nn.Linear(2, 2)
    except RuntimeError as e:
        return "WORLD_SIZE=4" in str(e)
    finally:
        os.environ["WORLD_SIZE"] = old
    return False


def test_single_rank_group_guard():
    assert run(1, body_guard) == [True]


def test_meta_of_plain_tensor_raises():
    assert not is_partitioned(torch.zeros(2)) and not is_partitioned(nn.Parameter(torch.zeros(1)))
    with pytest.raises(TypeError, match="not a partitioned parameter"):
        meta(nn.Parameter(torch.zeros(3)))
