"""Host allocator controls: make freed buffers leave the process (glibc only; no-ops elsewhere).

Sharded training allocates and frees large transient buffers every step (gathered weights,
full grads, flat collective buffers). glibc serves a freed large block from the heap next
time and raises its mmap threshold dynamically, so after a few steps those buffers stay
resident and RSS looks like no memory was saved (../shared/LESSONS.md: FSDP2 and ZeRO-3 both
peaked above DDP on CPU). Fixing the threshold makes every large buffer an mmap that is
returned to the OS when freed. Both calls are explicit: nothing here runs on import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Optional

_M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h


@functools.lru_cache(maxsize=1)
def _libc() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def set_mmap_threshold(num_bytes: int = 128 * 1024) -> bool:
    """Serve allocations of at least ``num_bytes`` with mmap (freed straight to the OS); True if applied."""
    if not isinstance(num_bytes, int) or num_bytes <= 0:
        raise ValueError(f"set_mmap_threshold: num_bytes must be a positive int, got {num_bytes!r}")
    libc = _libc()
    return bool(libc and libc.mallopt(_M_MMAP_THRESHOLD, num_bytes) == 1)


def trim_allocator() -> bool:
    """Return free heap pages to the OS now (``malloc_trim(0)``); True if glibc released any."""
    libc = _libc()
    return bool(libc and libc.malloc_trim(0) == 1)
