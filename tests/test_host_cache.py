"""parts.csrc.host_cache: freed large CPU blocks are reused by the next request of their size,
within the capacity and the recent peak of the bytes in use, without corrupting a tensor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parts.csrc import host_cache, native
from parts.offload import DiskStore
from parts.offload.plan import split_budget

MiB = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def installed():
    """The cache as torch's CPU allocator (skipped where the native build is unavailable)."""
    if not native.available():
        pytest.skip("native ops unavailable")
    before = host_cache.stats().capacity
    assert host_cache.install(64 * MiB)
    assert host_cache.stats().installed
    yield
    host_cache.install(before)  # the cache is process-wide: later tests see what they saw


def check_bounds() -> host_cache.HostCacheStats:
    """The cache's counters, after checking its two bounds."""
    s = host_cache.stats()
    assert s.kept_bytes <= s.capacity, s
    assert s.used_bytes + s.kept_bytes <= s.high_water_bytes, s
    return s


def test_a_freed_block_serves_the_next_request_of_its_size():
    a = torch.empty(3 * MiB, dtype=torch.uint8)
    ptr, before = a.data_ptr(), host_cache.stats()
    del a
    b = torch.empty(3 * MiB, dtype=torch.uint8)
    after = check_bounds()
    assert b.data_ptr() == ptr
    assert (after.hits, after.misses) == (before.hits + 1, before.misses)
    small = torch.empty(MiB // 2, dtype=torch.uint8)  # below min_bytes: glibc's, not counted
    assert host_cache.stats().misses == after.misses
    del small, b


def test_a_peak_older_than_the_last_period_lets_no_block_be_kept():
    host_cache.new_period()
    host_cache.new_period()
    blocks = [torch.empty(2 * MiB, dtype=torch.uint8) for _ in range(8)]
    del blocks
    assert check_bounds().kept_bytes >= 16 * MiB  # this period's peak held them
    host_cache.new_period()
    assert check_bounds().kept_bytes >= 16 * MiB  # the last period's peak still does
    host_cache.new_period()
    assert check_bounds().kept_bytes == 0


def test_a_lower_capacity_drops_kept_blocks_and_an_open_store_sets_it(tmp_path):
    capacity = host_cache.stats().capacity
    blocks = [torch.empty(2 * MiB, dtype=torch.uint8) for _ in range(4)]
    del blocks
    assert check_bounds().kept_bytes >= 8 * MiB
    assert host_cache.install(4 * MiB)
    assert check_bounds().kept_bytes <= 4 * MiB
    assert host_cache.install(0) and check_bounds().kept_bytes == 0
    with pytest.raises(ValueError, match="capacity"):
        host_cache.install(-1)
    store = DiskStore(str(tmp_path), memory_budget=256 * MiB)
    assert host_cache.stats().capacity == store.budget.host_cache_bytes == 256 * MiB
    store.close()
    assert host_cache.stats().capacity == 0  # no store open: nothing kept
    assert host_cache.install(capacity)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 7)), min_size=1, max_size=40))
def test_blocks_in_use_hold_their_values_and_the_bounds_hold(ops):
    live: list[tuple[torch.Tensor, int]] = []
    for n, (make, size, pick) in enumerate(ops):
        if make or not live:
            t = torch.empty(size * MiB // 4, dtype=torch.float32).fill_(n)  # sizes recur: hits
            live.append((t, n))
        else:
            live.pop(pick % len(live))
        check_bounds()
        if n % 9 == 8:
            host_cache.new_period()
    for t, value in live:
        assert bool((t == value).all()), f"a block in use was handed out again (value {value})"


@given(budget=st.integers(1 << 22, 1 << 40))
def test_a_budget_gives_the_host_cache_the_whole_budget_as_its_capacity(budget):
    assert split_budget(budget, 4, 8 << 20).host_cache_bytes == budget
