"""Tensors in a ``DiskStore`` lent out one at a time, for checkpoints of shards on disk.

``Stored(store, key, numel, dtype)`` names a range of a tensor's bytes in a store without
reading them. For the shape arithmetic of ``parts.comm.dcp.ShardView`` it behaves as a 1-D
tensor (``numel()``, ``dim()``, ``dtype``, ``device``, ``reshape(-1)``, ``narrow(0, lo,
n)``), never as data: it is a *deferred* segment of a view, and ``materialize()`` reads it
only when DCP asks for its data (saving one item, or loading one).

A store lends one stored tensor per thread at a time (its ``Lease``): materializing a range
of another tensor first gives the previous one back, written to the store if its buffer was
written into (a checkpoint load copied into it: its version counter moved), else just
dropped. A save or load of any number of stored tensors therefore holds one of them per
DCP thread beyond what DCP itself holds. ``settle()`` gives back everything lent (a load's
last write lands then; ``parts.comm.dcp.save``/``load`` and the ``load_sharded_*``
functions call it).

``owner``: the parked tensor (``parts.offload.parking``) whose bytes these are: when it is
loaded its memory is copied instead of reading the store, and a write-back goes through
``parking.replace`` (its version moves, so caches of a gathered parameter see the change).
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch

from parts.offload import parking
from parts.offload.store import DiskStore

_ATTR = "_parts_lease"


class Lease:
    """One store's lent tensors: per thread, the stored tensor, its buffer, its version when read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[int, tuple["Stored", torch.Tensor, int]] = {}

    def lend(self, stored: "Stored") -> torch.Tensor:
        """The whole tensor ``stored`` is a range of, in memory (this thread's previous one returned)."""
        tid = threading.get_ident()
        with self._lock:
            slot = self._slots.get(tid)
            if slot is not None and slot[0].same_tensor(stored):
                return slot[1]
            self._slots.pop(tid, None)
        if slot is not None:
            _give_back(slot)
        buffer = stored.read_whole()
        with self._lock:
            self._slots[tid] = (stored, buffer, buffer._version)
        return buffer

    def settle(self) -> None:
        """Give back every lent tensor (written ones are written to the store first)."""
        with self._lock:
            slots, self._slots = list(self._slots.values()), {}
        for slot in slots:
            _give_back(slot)

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers lent now."""
        with self._lock:
            return sum(buf.nbytes for _, buf, _ in self._slots.values())


def _give_back(slot: tuple["Stored", torch.Tensor, int]) -> None:
    stored, buffer, version = slot
    if buffer._version != version:
        stored.write_whole(buffer)


def lease_of(store: DiskStore) -> Lease:
    """The ``Lease`` of ``store`` (made on first use)."""
    lease = vars(store).get(_ATTR)
    if lease is None:
        lease = vars(store).setdefault(_ATTR, Lease())
    return lease


class Stored:
    """Elements ``[lo, lo + n)`` of the tensor of ``total`` elements stored under ``key`` (see above)."""

    def __init__(self, store: DiskStore, key: str, total: int, dtype: torch.dtype, *,
                 owner: Optional[torch.Tensor] = None, lo: int = 0, n: Optional[int] = None) -> None:
        n = total - lo if n is None else n
        if lo < 0 or n < 0 or lo + n > total:
            raise ValueError(f"Stored {key!r}: range [{lo}, {lo + n}) outside its {total} elements")
        self.store, self.key, self.total, self.dtype, self.owner = store, key, int(total), dtype, owner
        self.lo, self.n = int(lo), int(n)
        self.device = torch.device("cpu")

    # ---------------------------------------------------------- a 1-D tensor's shape arithmetic
    def numel(self) -> int:
        """Elements of the range."""
        return self.n

    def dim(self) -> int:
        """1: a flat range."""
        return 1

    @property
    def shape(self) -> torch.Size:
        """``(numel,)``."""
        return torch.Size((self.n,))

    def reshape(self, *shape: Any) -> "Stored":
        """Itself, for ``reshape(-1)`` (the only reshape a flat range has)."""
        if tuple(shape) not in ((-1,), ((-1,),), (self.n,), ((self.n,),)):
            raise ValueError(f"Stored {self.key!r}: a flat range reshapes to (-1,) only, not {shape}")
        return self

    def narrow(self, dim: int, start: int, length: int) -> "Stored":
        """The sub-range ``[start, start + length)`` of this range."""
        if dim != 0 or start < 0 or start + length > self.n:
            raise ValueError(f"Stored {self.key!r}: narrow({dim}, {start}, {length}) of a range of {self.n}")
        return Stored(self.store, self.key, self.total, self.dtype, owner=self.owner, lo=self.lo + start, n=length)

    def same_as(self, other: Any) -> bool:
        """The same range of the same stored tensor."""
        return isinstance(other, Stored) and self.same_tensor(other) and (self.lo, self.n) == (other.lo, other.n)

    def same_tensor(self, other: "Stored") -> bool:
        """Ranges of the same stored tensor."""
        return self.store is other.store and self.key == other.key

    def __repr__(self) -> str:
        return f"Stored({self.key!r}, [{self.lo}, {self.lo + self.n}) of {self.total}, {self.dtype})"

    # --------------------------------------------------------------------------------- data
    def materialize(self) -> torch.Tensor:
        """The range in memory: a view of the tensor the store's lease lends this thread."""
        return lease_of(self.store).lend(self).narrow(0, self.lo, self.n)

    def settle(self) -> None:
        """Give back what the store lent (written buffers go to the store)."""
        lease_of(self.store).settle()

    def read_whole(self) -> torch.Tensor:
        """The whole stored tensor, read into fresh memory (the owner's, if it is loaded)."""
        if self.owner is not None and parking.is_resident(self.owner):
            return self.owner.detach().reshape(-1).clone()
        out = parking.empty_for_io((self.total,), self.dtype)
        self.store.read(self.key, out).wait()
        return out

    def write_whole(self, values: torch.Tensor) -> None:
        """Store ``values`` as the whole tensor (through its owner, if any)."""
        if self.owner is not None:
            parking.replace(self.owner, values)
        else:
            self.store.write(self.key, values).wait()


def stored_of_parked(t: torch.Tensor) -> Optional[Stored]:
    """The whole of parked tensor ``t`` as a ``Stored`` (None if ``t`` is not parked)."""
    record = parking.parked(t)
    if record is None:
        return None
    return Stored(record.store, record.key, t.numel(), t.dtype, owner=t)
