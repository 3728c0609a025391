"""parts._compat: the gloo stand-ins give exactly what the torch collectives they replace give."""

import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from harness import run
from parts._compat import all_gather_flat, reduce_scatter_flat
from parts.comm.gloo import all_gather_direct, reduce_scatter_consuming

DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def _world_and_rest():
    """The default group, then (on ranks > 0) the group of all ranks but 0, where group rank
    r is global rank r + 1. Every rank calls ``new_group``, as torch requires."""
    world = dist.get_world_size()
    rest = dist.new_group(list(range(1, world))) if world > 1 else None
    return [None] + ([rest] if dist.get_rank() > 0 else [])


def body_all_gather_direct(numels, dtype_index, seed):
    """On the world and on the group of all ranks but 0: equal to all_gather_flat, sync and async."""
    dtype, rank = DTYPES[dtype_index], dist.get_rank()
    for group in _world_and_rest():
        size = dist.get_world_size(group)
        for numel in numels:
            shard = (torch.randn(numel, generator=torch.Generator().manual_seed(seed + rank)) * 100).to(dtype)
            expected = torch.empty(size * numel, dtype=dtype)
            all_gather_flat(expected, shard, group=group)
            for async_op in (False, True):
                got = torch.full((size * numel,), 7, dtype=dtype)
                work = all_gather_direct(got, shard, group=group, async_op=async_op)
                if async_op:
                    work.wait()
                assert torch.equal(got, expected), (group is None, numel, async_op)
    return True


@settings(max_examples=12, deadline=None)
@given(world=st.integers(1, 4), numels=st.lists(st.integers(0, 3000), min_size=1, max_size=3),
       dtype_index=st.integers(0, len(DTYPES) - 1), seed=st.integers(0, 2**16))
def test_all_gather_direct_equals_all_gather(world, numels, dtype_index, seed):
    assert run(world, body_all_gather_direct, numels, dtype_index, seed) == [True] * world


def body_reduce_scatter_consuming(numels, seed):
    """Sum (direct exchange on gloo) and max, world and sub-group, sync and async, divided or
    not: equal to reduce_scatter_flat on a copy. Integer values: sums are exact in any order."""
    rank = dist.get_rank()
    for group in _world_and_rest():
        size = dist.get_world_size(group)
        for numel, op, divide_by, async_op in _rs_cases(numels):
            g = torch.Generator().manual_seed(seed + rank)
            grad = torch.randint(-50, 50, (size * numel,), generator=g).float()
            expected = torch.empty(numel)
            reduce_scatter_flat(expected, grad.clone(), op=op, group=group)
            got = torch.full((numel,), 7.0)
            work = reduce_scatter_consuming(got, grad, op=op, group=group, async_op=async_op,
                                            divide_by=divide_by)
            if async_op:
                work.wait()
            assert torch.equal(got, expected / divide_by), (group is None, numel, op, divide_by)
    return True


def _rs_cases(numels):
    for numel in numels:
        for op, divide_by, async_op in [(dist.ReduceOp.SUM, 1, False), (dist.ReduceOp.SUM, 4, True),
                                        (dist.ReduceOp.MAX, 1, True)]:
            yield numel, op, divide_by, async_op


@settings(max_examples=12, deadline=None)
@given(world=st.integers(1, 4), numels=st.lists(st.integers(0, 3000), min_size=1, max_size=3),
       seed=st.integers(0, 2**16))
def test_reduce_scatter_consuming_equals_reduce_scatter(world, numels, seed):
    assert run(world, body_reduce_scatter_consuming, numels, seed) == [True] * world


def body_reduce_scatter_narrow_input(numels, seed):
    """bf16 input, fp32 output (MixedPrecision's grads): bitwise the result of casting the
    input up first, for a sum (bf16 on the wire on gloo) and a max, world and sub-group."""
    rank = dist.get_rank()
    for group in _world_and_rest():
        size = dist.get_world_size(group)
        for numel, op, divide_by, async_op in [*_rs_cases(numels), (numels[0], dist.ReduceOp.SUM, 3, False)]:
            g = torch.Generator().manual_seed(seed + rank)
            grad = torch.randn(size * numel, generator=g).to(torch.bfloat16)
            expected = torch.empty(numel)
            reduce_scatter_consuming(expected, grad.float(), op=op, group=group, divide_by=divide_by)
            got = torch.full((numel,), 7.0)
            work = reduce_scatter_consuming(got, grad, op=op, group=group, async_op=async_op,
                                            divide_by=divide_by)
            if async_op:
                work.wait()
            assert torch.equal(got, expected), (group is None, numel, op, divide_by)
    return True


@settings(max_examples=8, deadline=None)
@given(world=st.integers(1, 4), numels=st.lists(st.integers(0, 3000), min_size=1, max_size=3),
       seed=st.integers(0, 2**16))
def test_reduce_scatter_consuming_sums_a_narrow_input_in_the_output_dtype(world, numels, seed):
    assert run(world, body_reduce_scatter_narrow_input, numels, seed) == [True] * world
