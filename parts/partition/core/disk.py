"""Shards on disk: the few places where ``parts.partition`` meets ``parts.offload``.

With ``partitioned(remote_device=DiskStore(...))`` (or ``partition_module``) each shard is
*parked* (``parts.offload.parking``) right after its module's ``__init__``: written to the
store, its storage emptied; the shard tensor object (what ``shards(model)`` and the
optimizer hold) stays. From then on:

* ``gather`` loads a parked shard (waiting the read the coordinator issued ahead, or
  reading it now) as the send buffer of its all-gather, and empties it again as soon as
  the all-gather has landed: the full tensor is what forward and backward use, so the
  shard buffer lives only from its read to its all-gather (``release`` frees the full one);
* the coordinator issues those reads ahead along its trace (``read_ahead``), over twice
  its prefetch window, so disk reads run ahead of the all-gathers, which run ahead of compute;
* reduce-scattered grad shards go to the store (``accumulate_grad``: read, add, write),
  from buffers allocated aligned (``grad_buffer``) so direct IO writes them without a copy;
* the optimizer step writes updated shards back: ``parts.offload.OffloadedOptimizer``
  loads each chunk's shards, grads and state, steps them and saves them (a plain torch
  optimizer stepping parked shards raises, it would see no grads);
* code that rewrites shards (``load_full_state_dict``, ``gathered(modifier_rank=...)``)
  goes through ``rewrite``, which loads, writes and saves back;
* sharded DCP checkpoints (``sharded_state_dict``) see a parked shard as ``stored(shard)``:
  read from the store when DCP saves it, written there when DCP loads it, one at a time;
* a parked shard's version (``parking.version``, bumped by every save) replaces its
  storage pointer in ``shard_version``, so persistent parameters are gathered again after
  an optimizer step, as in memory.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

from parts.offload import landing, parking
from parts.offload.lease import Stored, stored_of_parked
from parts.offload.staging import staging
from parts.offload.store import DiskStore

READ_AHEAD_FACTOR = 2
"""Disk reads reach this many prefetch windows (``prefetch_bucket_size`` elements) ahead."""


def store_of(remote_device: Any) -> Optional[DiskStore]:
    """The ``DiskStore`` if ``remote_device`` is one, else None."""
    return remote_device if isinstance(remote_device, DiskStore) else None


def park_shard(shard: torch.Tensor, store: DiskStore, pid: int, name: str = "") -> None:
    """Write a new shard of parameter ``name`` to ``store`` and empty its memory."""
    parking.park(shard, store, f"shard/{pid}", label=f"shard of {name}" if name else "")


def load_for_send(shard: torch.Tensor) -> bool:
    """Make a parked shard's bytes present before its all-gather (no-op for others); True if parked."""
    if parking.parked(shard) is None:
        return False
    parking.load(shard)
    return True


def after_send(shard: torch.Tensor) -> None:
    """Empty a parked shard once its all-gather landed (its bytes stay in the store), unless an
    optimizer stepping during backward holds it (``parking.hold``)."""
    if parking.parked(shard) is not None:
        parking.release(shard)


def stored(t: torch.Tensor) -> Optional[Stored]:
    """A parked tensor as a ``Stored`` (a deferred segment of a DCP view; read when DCP asks), or None."""
    return stored_of_parked(t)


def parked_version(shard: torch.Tensor) -> Optional[int]:
    """Saves of a parked shard so far, or None if it is not parked."""
    record = parking.parked(shard)
    return None if record is None else record.version


def grad_buffer(shard: torch.Tensor, numel: int, dtype: torch.dtype,
                alloc: Callable[[int, torch.dtype], torch.Tensor], device: torch.device) -> torch.Tensor:
    """A fresh 1-D tensor for ``shard``'s reduce-scattered grad on the compute ``device``:
    ``alloc(numel, dtype)`` (there), or on the CPU for a parked shard an aligned one (its store
    writes it as is) whose memory the store's reuse pool may give (``landing.grad_buffer``; the
    step during backward gives it back). On an accelerator the grad lands there and goes to
    the host in ``accumulate_grad``."""
    if parking.parked(shard) is None or shard.device.type != "cpu" or staging.streams.accelerated(device):
        return alloc(numel, dtype)
    return landing.grad_buffer(shard, numel, dtype, alloc)


def accumulate_grad(shard: torch.Tensor, part: torch.Tensor, accumulate: bool) -> bool:
    """Add ``part`` into a parked shard's grad in the store; False (nothing done) if not parked.
    A ``part`` on an accelerator is copied into an aligned, pinned host block off the compute
    stream first (``staging.to_host``); whoever reads the block waits for the copy."""
    if parking.parked(shard) is None:
        return False
    if staging.wants_host(part):
        host = landing.grad_buffer(shard, part.numel(), part.dtype, staging.host_empty)
        part = staging.to_host(part, host)
    parking.accumulate_grad(shard, part, accumulate)
    return True


def to_device(shard: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``shard`` on the compute ``device`` in ``dtype`` for its all-gather: from host memory to an
    accelerator on a copy stream (the shard's memory is not reused before the copy is done),
    else ``shard.to(device, dtype, non_blocking=True)``."""
    return staging.to_device(shard, device, dtype)


def clear_grad(shard: torch.Tensor) -> None:
    """Forget a parked shard's grad in the store (nothing for a shard in memory)."""
    if parking.parked(shard) is not None:
        parking.clear_grad(shard)


def drives_parked(optimizer: Any) -> bool:
    """True for an optimizer that steps parked tensors (``parts.offload.OffloadedOptimizer``)."""
    return bool(getattr(optimizer, "drives_parked_tensors", False))


def park_master(master: torch.Tensor, shard: torch.Tensor, key: str) -> None:
    """Put ``BF16Optimizer``'s fp32 master of a parked shard in the shard's store; the
    master's grad is the shard's stored grad."""
    parking.park(master, parking.parked(shard).store, key, grad_of=shard)


@contextlib.contextmanager
def peek(t: torch.Tensor) -> Iterator[None]:
    """Inside, a parked tensor holds its bytes (read only: dropped on exit, not saved)."""
    if parking.parked(t) is None:
        yield
        return
    parking.load(t)
    try:
        yield
    finally:
        parking.drop(t)


def overwrite(t: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` (cast to its dtype) into parked ``t`` without reading it first."""
    parking.overwrite(t, values)


def has_grad(t: torch.Tensor) -> bool:
    """True if parked ``t`` has a grad in the store."""
    return parking.has_grad(t)


def takes_grads(shard: torch.Tensor) -> bool:
    """True if a step during backward takes ``shard``'s grads as they land (they skip the store)."""
    return parking.takes_grad(shard)


def grad_dtype(shard: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype of parked ``shard``'s stored grad (None: none stored, or not parked)."""
    return parking.grad_dtype(shard)


def store_of_parked(shard: torch.Tensor) -> DiskStore:
    """The store a parked shard lives in."""
    return parking.parked(shard).store


def read_grads(shards: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The stored grads of parked ``shards`` (one dtype) read into one zeroed buffer (one all-reduce
    for all): ``(buffer, each grad's view of it)``."""
    return parking.load_grads(shards)


def write_grads(shards: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Store ``grads`` as the grads of parked ``shards`` (replacing them), all written when it returns."""
    handles = [parking.write_grad(s, g) for s, g in zip(shards, grads)]
    for handle in handles:
        handle.wait()


def read_grad(t: torch.Tensor) -> torch.Tensor:
    """Parked ``t``'s stored grad, read into fresh memory."""
    grad, handle = parking.load_grad(t)
    handle.wait()
    return grad


def scale_grad(shard: torch.Tensor, coef: float) -> None:
    """Multiply a parked shard's stored grad by ``coef`` (read, scale, write back)."""
    grad = read_grad(shard)
    grad.mul_(coef)
    parking.accumulate_grad(shard, grad, accumulate=False)


def consumed_norm(shard: torch.Tensor, norm_type: float) -> Optional[torch.Tensor]:
    """The ``norm_type`` norm of the grad of ``shard`` that a step during backward consumed
    (``OffloadedOptimizer.step_in_backward``), or None if no step consumed one."""
    record = parking.parked(shard)
    if record is None or record.consumed is None:
        return None
    norms = record.consumed()
    if float(norm_type) not in norms:
        raise ValueError(f"grad norm of order {norm_type}: the grad of the shard stored under "
                         f"{record.key!r} was consumed by a step during backward, which keeps its "
                         f"norms of orders {sorted(norms)} only; pass it norm_types "
                         f"(OffloadedOptimizer.step_in_backward(norm_types=(2.0, {float(norm_type)})))")
    return norms[float(norm_type)]


@contextlib.contextmanager
def rewrite(shard: torch.Tensor) -> Iterator[None]:
    """Inside, a parked shard holds its bytes; on exit they are saved back and dropped."""
    if parking.parked(shard) is None:
        yield
        return
    parking.load(shard)
    yield
    parking.save(shard).wait()
    parking.drop(shard)


def read_ahead(recs: Any, plan: Any, position: int, window: int, gathered: Any, *,
               max_reuse_distance: int) -> int:
    """Start disk reads of parked shards used after ``position`` within ``window`` elements,
    skipping params ``gathered(pid)`` says are present; returns the reads started. A shard used
    twice in the window stays loaded from the first use to the second (``parking.want``) if the
    first use all-gathers it and the parameter is released between the two, as the coordinator
    does when the uses are at least ``max_reuse_distance`` elements of other fetches apart: a
    parameter kept gathered is not all-gathered again, and its shard would just stay loaded."""
    started, seen, last, loads = 0, 0, {}, {}  # pid -> its last use so far, and whether it all-gathers
    for k in range(position + 1, len(plan.sets)):
        for pid in plan.sets[k]:
            shard = recs[pid].shard
            record = parking.parked(shard)
            if record is None:
                continue
            present = gathered(pid)
            if pid in last:
                released = plan.prefix[k] - plan.prefix[last[pid] + 1] >= max_reuse_distance
                if loads[pid] and released:
                    parking.want(shard)
                loads[pid] = released
            else:
                loads[pid] = not present
            last[pid] = k
            if not record.resident and record.pending is None and not present:
                parking.prefetch(shard, urgent=True)  # an all-gather, then compute, waits for it
                started += 1
        seen += plan.prefix[k + 1] - plan.prefix[k]
        if seen >= window:
            break
    return started
