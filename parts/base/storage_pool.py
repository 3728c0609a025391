"""``StoragePool``: freed CPU memory kept by exact byte size, moved into the next storage of that size.

Memory asked of the host allocator for a large tensor costs either page faults at every
first touch (freed large blocks go back to the OS, as with a small mmap threshold: a page
fault and a zeroed page per 4 KiB, about 0.5 s of CPU per GiB against 0.09 into memory
touched before; ``benchmarks/bench_offload.py`` prints both) or a heap that keeps the blocks
fragmented among activations (glibc's default). The same sizes come back again and again (a
model's layers repeat), so the pool keeps what is freed, by exact byte size, and moves it
into the storage of the next tensor of that size; the storage object stays the tensor's own
(``parts._compat.swap_storage_data``), so views autograd saved keep working. Two users:

- ``parts.partition``: ``release(..., free_storage=True, pool=)`` puts full parameters' memory,
  ``gather`` takes it. The coordinator's pool is unbounded and settles after one step at about
  the most full-parameter bytes ever gathered at once, as CUDA's caching allocator does on a
  GPU (there the pool is not used).
- ``parts.offload``: ``DiskStore.reuse`` keeps what dropped parked tensors gave up, for their
  next loads, within ``reuse_bytes`` (so it is a fixed term of ``memory_bound``).

``capacity`` bounds the bytes held: a new block evicts the oldest ones until it fits (a block
larger than ``capacity`` is not kept). ``newest_first`` says which of several blocks of one
size a take gets. Off the CPU, or on a torch that cannot move memory between storages,
nothing is kept and the caller allocates afresh.
"""

from __future__ import annotations

from typing import Optional

import torch

from parts._compat import can_swap_storage_data, swap_storage_data


class StoragePool:
    """Freed storages' memory by byte size, at most ``capacity`` bytes (None: unbounded)."""

    def __init__(self, capacity: Optional[int] = None, *, newest_first: bool = True) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"StoragePool: capacity must be >= 0 bytes or None, got {capacity}")
        self.capacity = None if capacity is None else int(capacity)
        self.newest_first = newest_first
        self._blocks: dict[int, torch.UntypedStorage] = {}  # id -> a held block, oldest first
        self._sizes: dict[int, dict[int, None]] = {}  # nbytes -> ids of the blocks that size, oldest first
        self.held_bytes = 0
        self.reused = 0  # takes served from held memory (for tests and benchmarks)

    @property
    def cached_bytes(self) -> int:
        """``held_bytes``, under the name of the coordinator's stats."""
        return self.held_bytes

    def accepts(self, storage: torch.UntypedStorage) -> bool:
        """True if ``storage``'s memory can be kept (CPU, this torch moves memory between storages)."""
        return self.capacity != 0 and storage.device.type == "cpu" and can_swap_storage_data()

    def put(self, storage: torch.UntypedStorage) -> bool:
        """Move ``storage``'s memory into the pool (0 bytes left); False if not kept: the caller frees it."""
        nbytes = storage.nbytes()
        too_big = self.capacity is not None and nbytes > self.capacity
        if nbytes == 0 or too_big or not self.accepts(storage):
            return False
        holder = torch.UntypedStorage(0, device=storage.device)
        swap_storage_data(holder, storage)
        while self.capacity is not None and self.held_bytes + nbytes > self.capacity:
            self._remove(next(iter(self._blocks)))
        self._blocks[id(holder)] = holder
        self._sizes.setdefault(nbytes, {})[id(holder)] = None
        self.held_bytes += nbytes
        return True

    def give(self, storage: torch.UntypedStorage) -> None:
        """Empty ``storage`` (0 bytes after): its memory is kept if the pool takes it, else freed."""
        if not self.put(storage):
            storage.resize_(0)

    def take(self, nbytes: int, device: torch.device) -> Optional[torch.UntypedStorage]:
        """A storage holding a kept block of exactly ``nbytes`` on ``device``, or None."""
        ids = self._sizes.get(nbytes) if device.type == "cpu" else None
        if not ids:
            return None
        self.reused += 1
        return self._remove(next(reversed(ids)) if self.newest_first else next(iter(ids)))

    def take_into(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        """Give the empty ``storage`` a kept block of exactly ``nbytes``; False if none is free."""
        block = self.take(nbytes, storage.device) if storage.nbytes() == 0 else None
        if block is None:
            return False
        swap_storage_data(storage, block)
        return True

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give ``storage`` ``nbytes`` of memory: a kept block of that size if it is empty, else fresh."""
        if not self.take_into(storage, nbytes):
            storage.resize_(nbytes)

    def clear(self) -> None:
        """Free every kept block."""
        self._blocks.clear()
        self._sizes.clear()
        self.held_bytes = 0

    def _remove(self, key: int) -> torch.UntypedStorage:
        block = self._blocks.pop(key)
        same = self._sizes[block.nbytes()]
        del same[key]
        if not same:
            del self._sizes[block.nbytes()]
        self.held_bytes -= block.nbytes()
        return block
