"""``Reuse``: the memory of dropped parked tensors, kept for the next load of the same byte size.

A parked tensor (``parking``) gets memory at each load and gives it up at each drop. From
the host allocator that memory is fresh every time (freed large blocks go back to the OS
with a small mmap threshold): the store's read into it then pays a page fault and a zeroed
page per 4 KiB, on the IO thread, about 0.5 s of CPU per GiB against 0.09 into memory
touched before (``benchmarks/bench_offload.py`` prints both). Shards repeat their sizes (a
model's layers repeat), so ``Reuse`` keeps what ``drop`` frees, by exact byte size, and
moves it into the storage of the next load of that size (the storage object stays the
tensor's own: ``parts._compat.swap_storage_data``). It holds at most ``capacity`` bytes:
a block that would exceed it is freed (the oldest blocks go first), so the memory it
keeps is a fixed term of ``memory_bound``. Off the CPU, or on a torch that cannot move
memory between storages, nothing is kept and loads allocate as before.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch

from parts._compat import can_swap_storage_data, swap_storage_data

__all__ = ["Reuse"]


class Reuse:
    """Dropped storages' memory by byte size, at most ``capacity`` bytes; ``give`` on drop, ``fill`` on load."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"Reuse: capacity must be >= 0 bytes, got {capacity}")
        self.capacity = int(capacity)
        self._free: "OrderedDict[int, torch.UntypedStorage]" = OrderedDict()  # id -> a held block, oldest first
        self.held_bytes = 0
        self.reused = 0  # loads served from kept memory (for tests and benchmarks)

    def accepts(self, storage: torch.UntypedStorage) -> bool:
        """True if ``storage``'s memory can be kept (CPU, this torch moves memory between storages)."""
        return self.capacity > 0 and storage.device.type == "cpu" and can_swap_storage_data()

    def give(self, storage: torch.UntypedStorage) -> None:
        """Empty ``storage`` (0 bytes after), keeping its memory if it fits within ``capacity``."""
        nbytes = storage.nbytes()
        if nbytes == 0 or nbytes > self.capacity or not self.accepts(storage):
            storage.resize_(0)
            return
        holder = torch.UntypedStorage(0, device=storage.device)
        swap_storage_data(holder, storage)
        while self.held_bytes + nbytes > self.capacity:
            self.held_bytes -= self._free.popitem(last=False)[1].nbytes()
        self._free[id(holder)] = holder
        self.held_bytes += nbytes

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty ``storage`` ``nbytes`` of memory: a kept block of that size, else fresh."""
        block = self._take(nbytes) if self.accepts(storage) else None
        if block is None:
            storage.resize_(nbytes)
            return
        swap_storage_data(storage, block)
        self.reused += 1

    def clear(self) -> None:
        """Free every kept block."""
        self._free.clear()
        self.held_bytes = 0

    def _take(self, nbytes: int) -> Optional[torch.UntypedStorage]:
        for key, block in self._free.items():  # a few dozen blocks at most: a linear scan, oldest first
            if block.nbytes() == nbytes:
                del self._free[key]
                self.held_bytes -= nbytes
                return block
        return None
