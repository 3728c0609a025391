"""``store.reuse``: a dropped parked tensor's memory serves the next load of its size, within a byte cap."""

import pytest
import torch

from parts._compat import can_swap_storage_data
from parts.offload import DiskStore, parking
from parts.base.storage_pool import StoragePool

pytestmark = pytest.mark.skipif(not can_swap_storage_data(), reason="this torch cannot move storage memory")


def store_pool(capacity: int) -> StoragePool:
    """A pool as ``DiskStore`` makes its ``reuse``: bounded, the oldest block of a size taken first."""
    return StoragePool(capacity, newest_first=False)


def _storage(nbytes: int) -> torch.UntypedStorage:
    return torch.empty(nbytes, dtype=torch.uint8).untyped_storage()


def test_memory_moves_to_the_next_storage_of_its_size():
    reuse = store_pool(1 << 20)
    a = _storage(4096)
    ptr = a.data_ptr()
    reuse.give(a)
    assert a.nbytes() == 0 and reuse.held_bytes == 4096
    other = torch.UntypedStorage(0)
    reuse.fill(other, 8192)  # another size: fresh memory, the kept block stays
    assert other.nbytes() == 8192 and reuse.held_bytes == 4096 and reuse.reused == 0
    b = torch.UntypedStorage(0)
    reuse.fill(b, 4096)
    assert b.nbytes() == 4096 and b.data_ptr() == ptr and reuse.held_bytes == 0 and reuse.reused == 1


def test_capacity_frees_the_oldest_blocks():
    reuse = store_pool(10_000)
    blocks = [_storage(4096) for _ in range(3)]
    ptrs = [s.data_ptr() for s in blocks]
    for s in blocks:
        reuse.give(s)
    assert reuse.held_bytes == 8192  # the first block went when the third came
    taken = []
    for _ in range(3):
        s = torch.UntypedStorage(0)
        reuse.fill(s, 4096)
        taken.append(s.data_ptr())
    assert taken[:2] == ptrs[1:] and reuse.reused == 2
    reuse.give(_storage(20_000))  # larger than the cap: freed, not kept
    assert reuse.held_bytes == 0
    with pytest.raises(ValueError, match="capacity"):
        StoragePool(-1)


def test_zero_capacity_keeps_nothing():
    reuse = store_pool(0)
    s = _storage(4096)
    reuse.give(s)
    assert s.nbytes() == 0 and reuse.held_bytes == 0


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_parked_tensors_load_into_the_memory_of_earlier_drops(tmp_path, direct):
    """Two same-size parked tensors loaded in turn: from the second load on each lands in the
    memory the other's drop left, with its own bytes exact; the cap bounds what is kept."""
    with DiskStore(tmp_path, direct=direct, reuse_bytes=1 << 20) as store:
        values = [torch.randn(64 << 10, generator=torch.Generator().manual_seed(i)) for i in range(2)]
        tensors = [v.clone() for v in values]
        for i, t in enumerate(tensors):
            parking.park(t, store, f"t{i}")
        assert store.reuse.held_bytes <= store.reuse.capacity
        for _ in range(3):
            for t, v in zip(tensors, values):
                parking.load(t)
                assert torch.equal(t, v)
                t.add_(1)
                v.add_(1)
                parking.save(t).wait()
                parking.drop(t)
        # the first load is fresh (a load takes 4 KiB more than the parked tensor's own memory, to
        # start aligned); every later one lands in memory an earlier drop left
        assert store.reuse.reused == 5
    assert store.reuse.held_bytes == 0  # close frees it
