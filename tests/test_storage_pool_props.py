"""StoragePool against a model, under any sequence of puts and takes, bounded or not, either take order."""

from typing import Optional

import pytest
import torch
from hypothesis import given, settings, strategies as st

from parts._compat import can_swap_storage_data
from parts.base.storage_pool import StoragePool

pytestmark = pytest.mark.skipif(not can_swap_storage_data(), reason="this torch cannot move storage memory")

CPU = torch.device("cpu")
OPS = st.lists(st.tuples(st.sampled_from(["put", "give", "take", "take_into", "fill"]),
                         st.sampled_from([4, 12, 64])), max_size=40)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))


def _take(pool: StoragePool, op: str, nbytes: int) -> Optional[torch.UntypedStorage]:
    """Take ``nbytes`` the way ``op`` does; the storage holding a kept block, or None."""
    if op == "take":
        return pool.take(nbytes, CPU)
    target, reused = torch.UntypedStorage(0), pool.reused
    if op == "take_into":
        took = pool.take_into(target, nbytes)
        assert took == (pool.reused > reused) and target.nbytes() == (nbytes if took else 0)
    else:
        pool.fill(target, nbytes)
        assert target.nbytes() == nbytes  # kept or fresh, always the size asked
    return target if pool.reused > reused else None


@settings(max_examples=80, deadline=None)
@given(ops=OPS, capacity=st.one_of(st.none(), st.integers(0, 160)), newest_first=st.booleans())
def test_pool_matches_a_model(ops, capacity, newest_first):
    """The model: (size, value) of the held blocks, oldest first; a block that does not fit
    evicts the oldest, a take gets the newest (or oldest) of its size, with its bytes."""
    pool, held, served = StoragePool(capacity, newest_first=newest_first), [], 0
    for serial, (op, nbytes) in enumerate(ops):
        if op in ("put", "give"):
            storage = torch.full((nbytes,), serial % 251, dtype=torch.uint8).untyped_storage()
            kept = capacity is None or nbytes <= capacity
            if op == "put":
                assert pool.put(storage) == kept
            else:
                pool.give(storage)
            assert storage.nbytes() == (0 if kept or op == "give" else nbytes)
            while kept and capacity is not None and sum(n for n, _ in held) + nbytes > capacity:
                held.pop(0)
            held += [(nbytes, serial % 251)] if kept else []
        else:
            same = [i for i, (n, _) in enumerate(held) if n == nbytes]
            expected = held.pop(same[-1 if newest_first else 0])[1] if same else None
            block = _take(pool, op, nbytes)
            assert (block is None) == (expected is None)
            if block is not None:
                served += 1
                assert torch.equal(_bytes(block), torch.full((nbytes,), expected, dtype=torch.uint8))
        assert pool.held_bytes == pool.cached_bytes == sum(n for n, _ in held)
        assert capacity is None or pool.held_bytes <= capacity
        assert pool.reused == served
    pool.clear()
    assert pool.held_bytes == 0 and all(pool.take(n, CPU) is None for n in (4, 12, 64))
