"""The host heap under an offloaded run: large freed blocks go back to the system at once.

glibc serves a block of at least its mmap threshold with ``mmap`` (returned to the system
when freed) and a smaller one from its heap (kept by the process). The threshold starts at
128 KiB and rises to the size of each mmapped block freed, up to 32 MiB: after a few steps
the store's shard, grad and state buffers of 1-32 MiB (read into and freed by the IO and
training threads) all come from the heap, and the freed ones stay resident, so RSS grows
with the model although its states live on disk. A fixed threshold (``mallopt``, which also
stops the dynamic rise) keeps every block of at least ``MMAP_THRESHOLD`` out of the heap:
what an offloaded run holds is then what it uses. Applied once per process by the first
``DiskStore``, unless the user set ``MALLOC_MMAP_THRESHOLD_`` (theirs wins); a no-op off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

MMAP_THRESHOLD = 1 << 20  # blocks of at least 1 MiB bypass the heap; smaller ones stay fast
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
_lock = threading.Lock()
_applied: list[bool] = []  # [result] once tried in this process


def _mallopt(num_bytes: int) -> bool:
    name = ctypes.util.find_library("c")
    if not name:
        return False
    libc = ctypes.CDLL(name)
    return hasattr(libc, "mallopt") and libc.mallopt(_M_MMAP_THRESHOLD, num_bytes) == 1


def bound_heap() -> bool:
    """Fix glibc's mmap threshold at ``MMAP_THRESHOLD`` once per process; True if it is fixed (by
    this call, an earlier one, or the user's ``MALLOC_MMAP_THRESHOLD_``)."""
    with _lock:
        if not _applied:
            user = os.environ.get("MALLOC_MMAP_THRESHOLD_")
            _applied.append(bool(user) or _mallopt(MMAP_THRESHOLD))
        return _applied[0]
