"""StoragePool: freed full-parameter memory moves, by exact byte size, into the next gather."""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from harness import run
from parts.partition import StoragePool, gather, meta, partition_module, release

OPS = st.lists(st.tuples(st.sampled_from(["put", "take"]), st.sampled_from([4, 12, 64])),
               min_size=1, max_size=30)


@settings(max_examples=30, deadline=None)
@given(ops=OPS)
def test_pool_keeps_bytes_by_size(ops):
    """Against a model (a stack of byte strings per size): what comes out is what went in, last first."""
    pool, model = StoragePool(), {}
    for serial, (op, nbytes) in enumerate(ops):
        if op == "put":
            storage = torch.full((nbytes,), serial % 251, dtype=torch.uint8).untyped_storage()
            assert pool.put(storage) and storage.nbytes() == 0
            model.setdefault(nbytes, []).append(serial % 251)
        else:
            target = torch.empty(0, dtype=torch.uint8)
            took = pool.take_into(target.untyped_storage(), nbytes)
            assert took == bool(model.get(nbytes))
            if took:
                target.set_(target.untyped_storage(), 0, (nbytes,))
                assert torch.equal(target, torch.full((nbytes,), model[nbytes].pop(), dtype=torch.uint8))
        assert pool.cached_bytes == sum(size * len(v) for size, v in model.items())
    pool.clear()
    assert pool.cached_bytes == 0 and not pool.take_into(torch.UntypedStorage(0), 4)


def test_pool_refuses_what_it_cannot_hold():
    """Empty or non-CPU storages stay with the caller; a target that still has bytes gets none."""
    pool = StoragePool()
    assert not pool.put(torch.UntypedStorage(0))
    assert not pool.put(torch.empty(4, device="meta").untyped_storage())
    assert pool.put(torch.ones(4).untyped_storage())
    full = torch.ones(4).untyped_storage()
    assert not pool.take_into(full, 16) and full.nbytes() == 16 and pool.cached_bytes == 16


def body_fresh_gather_reuses():
    """A parameter gathered for the first time takes the block another one of its size freed."""
    torch.manual_seed(5)
    twins = partition_module(nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)))
    first, second = twins[0].weight, twins[1].weight
    pool = StoragePool()
    gather([first], pool=pool)
    block = first.data.untyped_storage().data_ptr()
    release([first], free_storage=True, pool=pool)
    assert pool.cached_bytes == meta(first).world_size * meta(first).layout.shard_numel * 4
    gather([second], pool=pool)
    assert second.data.untyped_storage().data_ptr() == block and pool.cached_bytes == 0
    values = second.data.clone()
    release([second], free_storage=True, pool=pool)
    gather([first, second], pool=pool)  # one block back to second, first gets fresh memory
    assert torch.equal(second.data, values) and pool.cached_bytes == 0
    return [p.data.sum().item() for p in (first, second)]


@pytest.mark.parametrize("world", [1, 2])
def test_fresh_gather_takes_a_freed_block_of_its_size(world):
    results = run(world, body_fresh_gather_reuses)
    assert all(r == results[0] for r in results)  # every rank sees the same full values
