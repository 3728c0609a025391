"""Parked tensors: a tensor whose bytes live in a ``DiskStore`` while its storage is empty.

``park(t, store, key)`` writes ``t`` to the store and resizes its storage to 0 bytes; the
tensor object (its identity, shape, dtype, and the optimizer or parameter record holding
it) stays. ``load`` refills the storage from the store (asynchronously: ``prefetch``),
``save`` writes changed bytes back and ``drop`` empties the storage again. ``version``
counts the saves, so code that caches a value derived from the tensor (a gathered full
parameter) can tell it changed while the storage was empty.

A step that may be rolled back saves under the staged key (``save(t, staged=True)``:
``<key>~staged``); ``commit`` makes it the tensor's bytes, ``unstage`` forgets it and empties
the storage (which held the uncommitted values), so the next load reads the old bytes.

A parked tensor may also carry a gradient in the store (``<key>/grad``):
``accumulate_grad`` adds into it (read, add, write), ``load_grad`` returns it,
``clear_grad`` deletes it. A ``save`` may still be in flight when the caller goes on (the
optimizer's writes behind a step): ``load``, ``drop``, ``overwrite`` and ``replace`` wait for it first, as the
write reads the storage they would change or free. Once anything is parked, a global optimizer pre-step hook makes a
plain torch optimizer that would step a parked tensor raise (it would see no grad and
silently skip it); ``OffloadedOptimizer`` sets ``driver.active`` around its own steps. These are
the integration points of ``parts.partition``
(shards on disk) and ``OffloadedOptimizer`` (which steps parked tensors chunk by chunk)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from parts.offload._fileio import ALIGN, aligned_empty, worth_aligning
from parts.offload.staging import staging
from parts.offload.store import DiskStore, IOHandle

_ATTR = "_parts_parked"
STAGED = "~staged"
"""Suffix of the store key a staged save writes to (``commit`` renames it to the tensor's key)."""


@dataclass(eq=False)
class Parked:
    """Where a parked tensor's bytes are and whether its storage holds them now."""

    store: DiskStore
    key: str
    nbytes: int
    version: int = 0
    resident: bool = False
    pending: Optional[IOHandle] = field(default=None, repr=False)  # a read into the storage
    saving: Optional[IOHandle] = field(default=None, repr=False)  # a write from the storage
    grad_dtype: Optional[torch.dtype] = None  # dtype of the stored grad (None: no grad stored)
    grad_of: Optional["Parked"] = field(default=None, repr=False)  # whose stored grad is this one's
    holds: int = 0  # holders (``hold``) for whom ``release`` keeps the bytes loaded
    on_grad: Optional[Callable[[torch.Tensor, bool], None]] = field(default=None, repr=False)  # takes landing grads
    staged: bool = False  # a save under the staged key awaits ``commit`` or ``unstage``
    # the norms (by order) of a grad consumed by a step during backward (a call: it may wait a read)
    consumed: Optional[Callable[[], dict[float, torch.Tensor]]] = field(default=None, repr=False)
    label: str = ""  # what errors call it: the parameter a shard belongs to, else its key
    keep: Optional[Callable[[], bool]] = field(default=None, repr=False)  # True: ``release`` keeps it loaded
    wanted: bool = False  # read ahead for a later use too: the next ``release`` keeps the bytes (``want``)

    @property
    def grad_key(self) -> str:
        """The store key of the tensor's gradient."""
        return f"{self.key}/grad"


def _grad_record(record: Parked) -> Parked:
    """The record holding ``record``'s grad: its own, or the one it borrows (``grad_of``)."""
    return record.grad_of if record.grad_of is not None else record


def parked(t: torch.Tensor) -> Optional[Parked]:
    """The ``Parked`` record of ``t``, or None for an ordinary tensor."""
    return getattr(t, "__dict__", {}).get(_ATTR)


class _Driver(threading.local):
    """Set while ``OffloadedOptimizer`` runs the wrapped optimizer's step (on this thread)."""

    active = False


driver = _Driver()
_guard: dict = {}


def _refuse_plain_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Global optimizer pre-step hook: a plain optimizer must not step parked tensors."""
    if driver.active or getattr(optimizer, "drives_parked_tensors", False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            record = parked(p)
            if record is not None:
                raise RuntimeError(
                    f"parts.offload: {type(optimizer).__name__}.step() on tensor {tuple(p.shape)} "
                    f"parked in a DiskStore (key {record.key!r}): its values and grads are on disk, "
                    f"so this step would silently skip it; wrap the optimizer: "
                    f"parts.offload.OffloadedOptimizer(optimizer, store)")


def _install_guard() -> None:
    if "handle" not in _guard:
        _guard["handle"] = register_optimizer_step_pre_hook(_refuse_plain_step)


def park(t: torch.Tensor, store: DiskStore, key: str, grad_of: Optional[torch.Tensor] = None,
         label: str = "") -> Parked:
    """Write ``t`` (contiguous, CPU) to ``store`` under ``key`` and empty its storage; with
    ``grad_of`` (a parked tensor of ``t``'s shape), ``t``'s grad is the one stored for it;
    ``label`` names it in errors (the parameter a shard belongs to)."""
    _install_guard()
    if parked(t) is not None:
        raise RuntimeError(f"parts.offload: tensor {tuple(t.shape)} is already parked under "
                           f"{parked(t).key!r}")
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.nbytes:
        raise ValueError(f"parts.offload: park needs a tensor that owns its whole storage "
                         f"(key {key!r}, shape {tuple(t.shape)}); pass a fresh contiguous tensor")
    record = Parked(store, key, t.nbytes, resident=True,
                    grad_of=None if grad_of is None else parked(grad_of), label=label or key)
    t.__dict__[_ATTR] = record
    store.write(key, t).wait()
    drop(t)
    return record


def is_resident(t: torch.Tensor) -> bool:
    """True if ``t``'s storage holds its bytes (loaded, or never parked)."""
    record = parked(t)
    return record is None or (record.resident and record.pending is None)


def version(t: torch.Tensor) -> int:
    """How many times ``save`` wrote ``t`` back since it was parked."""
    return parked(t).version


def empty_for_io(shape: torch.Size | tuple, dtype: torch.dtype,
                 alloc: Optional[Callable[[int, torch.dtype], torch.Tensor]] = None) -> torch.Tensor:
    """A fresh tensor a store moves without a copy (``ALIGN``-aligned memory: direct IO reads
    into it and writes from it in place); from ``alloc(numel, dtype)`` if given."""
    return aligned_empty(torch.Size(shape).numel(), dtype, alloc).view(shape)


def _refill(t: torch.Tensor, record: Parked) -> None:
    """Give parked ``t``'s empty storage room for its bytes (memory a drop left in the store's
    ``reuse`` if it kept a block of that size), starting ``ALIGN``-aligned if
    ``worth_aligning`` (the storage is ``ALIGN`` bytes longer and ``t`` starts inside it, so
    direct IO needs no copy; ``set_`` moves its start, which bumps its version counter)."""
    storage = t.untyped_storage()
    extra = ALIGN if worth_aligning(record.nbytes) else 0
    staging.fill(storage, record.store.reuse, record.nbytes + extra)
    skip = (-storage.data_ptr()) % ALIGN
    offset = skip // t.element_size() if extra and skip % t.element_size() == 0 else 0
    if offset != t.storage_offset():
        with torch.no_grad():
            t.set_(storage, offset, t.shape, t.stride())


def prefetch(t: torch.Tensor, urgent: bool = False) -> None:
    """Start reading ``t``'s bytes into its (refilled) storage; no-op if resident or in flight;
    ``urgent``: compute will wait for it (the store queues it before other reads)."""
    record = parked(t)
    if record.resident or record.pending is not None:
        return
    _refill(t, record)
    record.pending = record.store.read(record.key, t, urgent=urgent)


def load(t: torch.Tensor) -> None:
    """Make ``t``'s storage hold its bytes (waiting a prefetch, or reading now) with no write of
    them in flight."""
    record = parked(t)
    if record is None:
        return
    prefetch(t, urgent=True)  # a read started now is waited for at once
    _wait_save(record)  # the caller may change the bytes once loaded
    if record.pending is not None:
        pending, record.pending = record.pending, None
        try:
            pending.wait()
        except BaseException as e:
            record.store.reuse.give(t.untyped_storage())
            if isinstance(e, OSError) and e.errno is not None:
                raise OSError(e.errno, f"parameter {record.label!r} cannot be loaded: {e.strerror}") from e
            raise
        record.resident = True


def drop(t: torch.Tensor) -> None:
    """Empty ``t``'s storage (its bytes stay in the store; its memory goes to the store's ``reuse``);
    waits a read or a write in flight first."""
    record = parked(t)
    if record.pending is not None:
        load(t)
    _wait_save(record)
    staging.wait(t)  # a copy to the device may still read the memory
    record.store.reuse.give(t.untyped_storage())
    record.resident = record.wanted = False


def release(t: torch.Tensor) -> None:
    """``drop`` ``t`` unless a read of it is in flight (someone prefetched it since it was loaded:
    the bytes are theirs to use), someone ``hold``s it, it is ``want``ed by a later use, or its
    ``keep`` says a step will soon use the bytes; waits its write in flight either way."""
    record = parked(t)
    wanted, record.wanted = record.wanted, False
    if record.pending is None and record.holds == 0 and not wanted \
            and not (record.keep is not None and record.keep()):
        drop(t)
    else:
        _wait_save(record)


def want(t: torch.Tensor) -> None:
    """Keep ``t``'s bytes through its next ``release``: a reader ahead knows they serve a use after
    the next one too (the last forward layers' shards, used again first in backward), which
    would otherwise read them again right after dropping them."""
    parked(t).wanted = True


def hold(t: torch.Tensor) -> None:
    """Keep ``t``'s bytes loaded through ``release`` (an all-gather's) until ``unhold``: someone
    (``OffloadedOptimizer.step_in_backward``) read it ahead to step it soon."""
    parked(t).holds += 1


def unhold(t: torch.Tensor) -> None:
    """Undo one ``hold`` (the bytes stay loaded until the next ``release`` or ``drop``)."""
    record = parked(t)
    if record.holds <= 0:
        raise RuntimeError(f"parts.offload: unhold of {record.key!r}, which is not held")
    record.holds -= 1


def ready(t: torch.Tensor) -> bool:
    """True if ``load(t)`` would not wait for a read (resident, its read done, or not parked)."""
    record = parked(t)
    return record is None or record.resident or (record.pending is not None and record.pending.done)


def _wait_save(record: Parked) -> None:
    """Wait for the last ``save`` of ``record``'s storage (its memory must outlive the write)."""
    saving, record.saving = record.saving, None
    if saving is not None:
        saving.wait()


def save(t: torch.Tensor, staged: bool = False) -> IOHandle:
    """Write ``t``'s (changed) bytes back (under the staged key if ``staged``: ``commit`` makes
    them current); keep its storage until the handle is waited."""
    record = parked(t)
    if not record.resident:
        raise RuntimeError(f"parts.offload: save of {record.key!r}, which is not loaded")
    record.version += 1
    record.staged = staged
    record.saving = record.store.write(record.key + STAGED if staged else record.key, t)
    return record.saving


def commit(t: torch.Tensor) -> None:
    """Make the staged save of ``t`` its bytes (a rename in the store; no-op without one)."""
    record = parked(t)
    if record.staged:
        record.store.rename(record.key + STAGED, record.key)
        record.staged = False


def unstage(t: torch.Tensor) -> None:
    """Forget the staged save of ``t`` and empty its storage (it held those values): the next load
    reads the committed bytes; ``version`` moves, so values derived from the tensor are renewed."""
    record = parked(t)
    if record.pending is not None:
        load(t)
    _wait_save(record)
    if record.staged:
        record.store.delete(record.key + STAGED)
        record.staged = False
    if record.resident:
        drop(t)
    record.version += 1


def overwrite(t: torch.Tensor, values: torch.Tensor) -> None:
    """Give parked ``t`` the ``values`` (cast to its dtype) without reading its old bytes; saved, dropped.
    Values already of ``t``'s dtype and size go to the store as they are (``replace``: ``t`` stays empty)."""
    record = parked(t)
    if record.pending is not None:
        load(t)
    _wait_save(record)
    if not record.resident and values.dtype == t.dtype and values.numel() == t.numel() \
            and values.device.type == "cpu":
        replace(t, values.detach())
        return
    _refill(t, record)
    record.resident = True
    with torch.no_grad():
        t.copy_(values)
    save(t).wait()
    drop(t)


def replace(t: torch.Tensor, values: torch.Tensor) -> None:
    """Store ``values`` (flat, ``t``'s dtype and size) as parked ``t``'s bytes without loading ``t``
    (its memory too, if loaded); counted as a save (``version`` moves)."""
    record = parked(t)
    _wait_save(record)  # its memory may be written over below
    if values.dtype != t.dtype or values.numel() != t.numel():
        raise ValueError(f"parts.offload: replace of {record.key!r} ({t.numel()} x {t.dtype}) by "
                         f"{values.numel()} x {values.dtype}")
    if record.pending is not None:
        load(t)
    if record.resident:
        with torch.no_grad():
            t.copy_(values.view(t.shape))
        save(t).wait()
        return
    record.version += 1
    record.store.write(record.key, values.contiguous()).wait()


def accumulate_grad(t: torch.Tensor, part: torch.Tensor, accumulate: bool = True) -> None:
    """Add ``part`` into ``t``'s stored grad (or store it: first grad, or ``accumulate=False``);
    with an ``on_grad`` taker set (a step during backward), hand ``part`` to it instead."""
    record = _grad_record(parked(t))
    if record.on_grad is not None:
        record.on_grad(part, accumulate)
        return
    if accumulate and record.grad_dtype is not None:
        current = empty_for_io(t.shape, record.grad_dtype)
        record.store.read(record.grad_key, current).wait()
        staging.wait(part)  # a copy from the device may still fill it
        current.add_(part.to(current.device))
        part = current
    record.grad_dtype = part.dtype
    record.store.write(record.grad_key, part.detach().reshape(t.shape).contiguous())


def takes_grad(t: torch.Tensor) -> bool:
    """True if a taker (a step during backward) receives ``t``'s landing grads instead of the store."""
    record = parked(t)
    return record is not None and _grad_record(record).on_grad is not None


def grad_dtype(t: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype of ``t``'s grad in the store (None: no grad stored)."""
    record = parked(t)
    return None if record is None else _grad_record(record).grad_dtype


def load_grads(ts: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The stored grads of ``ts`` (one dtype) read into one zeroed buffer, each at an ``ALIGN``-aligned
    offset (direct IO fills it in place): ``(buffer, each grad's flat view of it)``."""
    dtype = grad_dtype(ts[0])
    step = max(1, ALIGN // dtype.itemsize)
    offsets, total = [], 0
    for t in ts:
        offsets.append(total)
        total += -(-t.numel() // step) * step
    flat = empty_for_io((total,), dtype).zero_()
    views = [flat.narrow(0, off, t.numel()) for off, t in zip(offsets, ts)]
    handles = [load_grad(t, lambda shape, dtype, v=v: v.view(shape))[1] for t, v in zip(ts, views)]
    for handle in handles:
        handle.wait()
    return flat, views


def write_grad(t: torch.Tensor, values: torch.Tensor) -> IOHandle:
    """Store ``values`` (``t``'s numel, contiguous) as ``t``'s grad, replacing it (no taker sees it);
    keep ``values`` unchanged until the handle is waited."""
    record = _grad_record(parked(t))
    record.grad_dtype = values.dtype
    return record.store.write(record.grad_key, values.detach().reshape(t.shape))


def has_grad(t: torch.Tensor) -> bool:
    """True if a gradient of ``t`` is in the store."""
    record = parked(t)
    return record is not None and _grad_record(record).grad_dtype is not None


def load_grad(t: torch.Tensor, empty: Optional[Callable[[torch.Size, torch.dtype], torch.Tensor]] = None
              ) -> tuple[torch.Tensor, IOHandle]:
    """A fresh tensor (``empty(shape, dtype)`` if given) and the handle of the read filling it
    with ``t``'s stored grad."""
    record = _grad_record(parked(t))
    grad = (empty or empty_for_io)(t.shape, record.grad_dtype)
    return grad, record.store.read(record.grad_key, grad)


def clear_grad(t: torch.Tensor) -> None:
    """Forget ``t``'s stored grad."""
    record = parked(t)
    record = None if record is None else _grad_record(record)
    if record is not None and record.grad_dtype is not None:
        record.store.delete(record.grad_key)
        record.grad_dtype = None
