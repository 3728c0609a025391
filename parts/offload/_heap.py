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

Each such block's next use then faults in fresh zeroed pages, and a training step makes the
same large blocks again and again; so the store also installs ``parts.csrc.host_cache``, which
keeps freed blocks of at least ``MMAP_THRESHOLD`` for the next request of their size while a
store is open, within what the process held at its peak in this step or the last (without
the native build the blocks just go back).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import itertools
import threading
from typing import Callable

from parts.csrc import host_cache

MMAP_THRESHOLD = 1 << 20  # blocks of at least 1 MiB bypass the heap; smaller ones stay fast
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
_lock = threading.Lock()
_applied: list[bool] = []  # [result] once tried in this process
_cache_asks: dict[int, int] = {}  # an open store's token -> the bytes its budget gives the host cache
_tokens = itertools.count()


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


def cache_blocks(nbytes: int) -> Callable[[], None]:
    """Let the host cache keep up to ``nbytes`` of freed large blocks (the most any open store
    asks for) until the returned function is called: with no store open it keeps none."""
    with _lock:
        token = next(_tokens)
        _cache_asks[token] = nbytes
        _resize_cache()
    return lambda: _forget(token)


def _forget(token: int) -> None:
    with _lock:
        if _cache_asks.pop(token, None) is not None:
            _resize_cache()


def _resize_cache() -> None:
    capacity = max(_cache_asks.values(), default=0)
    if capacity or host_cache.stats().installed:
        host_cache.install(capacity, MMAP_THRESHOLD)


def step_done() -> None:
    """A training step ended: the host cache keeps blocks within the peaks of this step and the last."""
    host_cache.new_period()
