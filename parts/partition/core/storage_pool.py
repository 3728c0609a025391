"""A cache of the memory of released full parameters, handed to the next gather of that size.

Each gather of a released parameter needs the memory of its full tensor again. Asked of
the host allocator every time, that memory costs either page faults on every gather (when
freed large blocks go back to the OS, as with a small mmap threshold) or a heap that keeps
the blocks fragmented among activations (glibc's default). ``StoragePool`` keeps what
``release(..., free_storage=True)`` frees, by byte size, and moves it into the storage of
the next gathered parameter of that size (the storage object stays the same, so views
autograd saved keep working). Models repeat their block shapes, so the pool settles after
one step at about the most full-parameter bytes ever gathered at once, as CUDA's caching
allocator does on a GPU; there the pool is not used (``accepts`` is False off the CPU).
"""

from __future__ import annotations

from typing import Optional

import torch

from parts._compat import can_swap_storage_data, swap_storage_data

__all__ = ["StoragePool"]


class StoragePool:
    """Freed full-parameter memory, by byte size; ``put`` when released, ``take``/``take_into`` to gather."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.UntypedStorage]] = {}
        self.cached_bytes = 0

    @staticmethod
    def accepts(storage: torch.UntypedStorage) -> bool:
        """True for CPU storages when this torch can move memory between storages."""
        return storage.device.type == "cpu" and can_swap_storage_data()

    def put(self, storage: torch.UntypedStorage) -> bool:
        """Move ``storage``'s memory into the pool (``storage`` is left with 0 bytes).

        False (nothing moved) for storages the pool does not take: the caller frees them.
        """
        nbytes = storage.nbytes()
        if nbytes == 0 or not self.accepts(storage):
            return False
        holder = torch.UntypedStorage(0, device=storage.device)
        swap_storage_data(holder, storage)
        self._free.setdefault(nbytes, []).append(holder)
        self.cached_bytes += nbytes
        return True

    def take(self, nbytes: int, device: torch.device) -> Optional[torch.UntypedStorage]:
        """A storage holding a cached block of exactly ``nbytes`` on ``device``, or None."""
        blocks = self._free.get(nbytes) if device.type == "cpu" else None
        if not blocks:
            return None
        self.cached_bytes -= nbytes
        return blocks.pop()

    def take_into(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        """Give the empty ``storage`` a cached block of exactly ``nbytes``; False if none is free."""
        block = self.take(nbytes, storage.device) if storage.nbytes() == 0 else None
        if block is None:
            return False
        swap_storage_data(storage, block)
        return True

    def clear(self) -> None:
        """Free every cached block."""
        self._free.clear()
        self.cached_bytes = 0
