"""Keep freed large CPU blocks for the next request of the same size (a C++ allocator, ``host_cache.cpp``).

A training step allocates the same large sizes again and again (weight grads, activations,
shards read from disk). Where each freed block goes back to the system, each new one faults in
fresh zeroed pages, one fault per page. The cache keeps freed blocks of at least ``min_bytes``
for the next request of exactly their size, at most ``capacity`` bytes, and never more than the
high-water mark of the large bytes in use at once allows: blocks in use plus blocks kept stay
within what the process held at its peak in this period or the last (``new_period``: a training
step), so the cache does not raise that peak. Process-wide once installed (torch's CPU
allocator is one per process); ``install`` again sets a new capacity, 0 keeps nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._build import NativeUnavailable, load_native

MIN_BYTES = 1 << 20  # smaller blocks stay with the allocator installed before (glibc's heap)


@dataclass(frozen=True)
class HostCacheStats:
    """Counters of the host cache: requests it served from kept blocks, and bytes it holds."""

    hits: int  # requests of at least min_bytes served by a kept block
    misses: int  # requests of at least min_bytes served by a fresh block
    kept_bytes: int  # freed blocks kept now
    used_bytes: int  # blocks it handed out that are in use now
    high_water_bytes: int  # the most bytes in use at once, this period or the last: in use + kept stay within
    capacity: int
    installed: bool  # torch's CPU allocator is this cache


def install(capacity: int, min_bytes: int = MIN_BYTES) -> bool:
    """Make the host cache torch's CPU allocator, keeping at most ``capacity`` bytes (a lower
    capacity than before drops kept blocks; ``min_bytes`` counts at the first install only);
    False if the native build is unavailable (nothing changes) or another allocator outranks it."""
    if capacity < 0 or min_bytes < 1:
        raise ValueError(f"host_cache.install: capacity must be >= 0 and min_bytes >= 1, got {capacity}, {min_bytes}")
    try:
        load_native()
    except NativeUnavailable:
        return False
    return bool(torch.ops.parts.host_cache_install(capacity, min_bytes))


def new_period() -> None:
    """Start a period (a training step): a peak from before the last one no longer lets blocks be kept."""
    if stats().installed:
        torch.ops.parts.host_cache_new_period()


def stats() -> HostCacheStats:
    """The cache's counters (all zero and not installed if ``install`` never succeeded)."""
    try:
        load_native()
    except NativeUnavailable:
        return HostCacheStats(0, 0, 0, 0, 0, 0, False)
    hits, misses, kept, used, high, capacity, installed = torch.ops.parts.host_cache_stats()
    return HostCacheStats(hits, misses, kept, used, high, capacity, bool(installed))
