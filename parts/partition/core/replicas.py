"""Hybrid layouts: grad shards averaged across the replica group, once per optimizer step.

In a hybrid layout (``partitioned(group=shard_group, replicate_group=replica_group)``) each
backward reduce-scatters the grads over the shard group (averaged there) and adds the result
into the grad shards, which then hold this replica's part only: the record is marked
pending. The all-reduce across replicas (sum, divided by the replica count: the mean over
every rank) runs once, right before something reads the grads: an optimizer step over the
shards (a process-wide step pre-hook), ``grad_norm``/``clip_grad_norm_``,
``BF16Optimizer.step``, or a coordinator at each backward's end when told so
(``FetchCoordinator.set_replica_sync("backward")``). Under gradient accumulation the
cross-replica bytes are so paid once per step, not once per micro-batch; syncing earlier
is exact too (an averaged grad shard is the same on every replica, and the mean of it plus
new parts is it plus the mean of the new parts).

Bucketed: the pending grad shards of one replica group, dtype and device are packed into
buckets of at most ``bucket_numel`` elements, one all-reduce each, in record-id order (the
same on every member of the group). Replicas stay bitwise identical: an all-reduce gives
every member the same sums.

Grad shards kept in a ``DiskStore`` (shards on disk: ``partitioned(remote_device=DiskStore(...))``)
are pending in ``_stored``: at the sync each bucket is read from the store into one buffer,
all-reduced, divided and written back, a bucket being at most the store's reduce share of its
memory budget (the full grads awaiting reduce-scatter, which hold that memory in backward, are
gone by then). A grad that a step during backward takes as it lands
(``OffloadedOptimizer.step_in_backward``) is averaged right there (``before_landing``), with the
sum of earlier micro-batches it is added to: the step must see the mean. Those landings come at
the same point of every replica's backward, so the replicas' all-reduces meet.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

import torch

from parts.comm import all_reduce, all_reduce_async, all_reduce_mean_quantized, group_key
from parts.partition.core import disk, exact
from parts.partition.core.compression import replica_codec
from parts.partition.core.param import ParamMeta, is_partitioned, meta
from parts.partition.core import steps
from parts.partition.core.steps import before_each_step

BUCKET_NUMEL = 25_000_000
"""Elements per cross-replica all-reduce (100 MB of fp32): few calls, bounded extra memory."""

_pending: "weakref.WeakSet[ParamMeta]" = weakref.WeakSet()
"""Records whose grad shard awaits its cross-replica all-reduce. Process-wide because the
optimizer step hook that drains it is; it configures nothing and forgets records that are gone."""
_stored: "weakref.WeakSet[ParamMeta]" = weakref.WeakSet()
"""Records whose grad shard in a ``DiskStore`` awaits it (apart: never overlapped with backward)."""
_flying: "weakref.WeakKeyDictionary[ParamMeta, list]" = weakref.WeakKeyDictionary()
"""Records whose grad shard is in a cross-replica all-reduce in flight: its run (``InFlight``)."""


def mark_pending(records: Iterable[ParamMeta]) -> None:
    """Note that these records' grad shards received a replica-local part (no-op without replicas)."""
    for m in records:
        if m.replica is not None:
            run = _flying.get(m)
            if run is not None:  # its all-reduce is in flight: finish it, the new part lands on the mean
                _complete(run)
            if disk.parked_version(m.shard) is not None:
                _stored.add(m)
            else:
                m.replica_pending = True
                _pending.add(m)
            before_each_step(_before_optimizer_step)


def before_landing(m: ParamMeta, part: torch.Tensor, accumulate: bool) -> tuple[torch.Tensor, bool]:
    """``(part, accumulate)`` to add into ``m``'s grad shard, which is then pending; for a step during
    backward that takes the grad as it lands: the mean across replicas of it plus the stored sum
    of earlier micro-batches (``accumulate`` False: nothing is left to add)."""
    if not disk.takes_grads(m.shard):
        mark_pending([m])
        return part, accumulate
    _stored.discard(m)
    if accumulate and disk.has_grad(m.shard):
        stored = disk.read_grad(m.shard)
        part = stored.add_(part.reshape(stored.shape)).reshape(-1)
        disk.clear_grad(m.shard)
    _mean(part, [m], [part])
    return part, False


def pending_now() -> list[ParamMeta]:
    """Every record whose grad shard awaits its cross-replica all-reduce."""
    return list(_pending)


def pending_records(params: Iterable[Any]) -> list[ParamMeta]:
    """The records of ``params`` (sharded parameters or records) whose grad shards await the all-reduce."""
    out = []
    for p in params:
        m = p if isinstance(p, ParamMeta) else (meta(p) if is_partitioned(p) else None)
        if m is not None and (m.replica_pending or m in _stored):
            out.append(m)
    return out


def sync_replica_grads(records: Iterable[ParamMeta], bucket_numel: int = BUCKET_NUMEL) -> int:
    """All-reduce (mean) the pending grad shards of ``records`` across their replica groups;
    returns how many were synced. Every member of a replica group must call it with the same
    records (the same optimizer, the same model)."""
    records = list(records)
    summed = _sync_exact(records)
    todo = _take(records)
    for chunk in _buckets(todo, bucket_numel):
        _all_reduce_mean(chunk)
    return summed + len(todo) + _sync_stored(records, bucket_numel)


def _sync_exact(records: list[ParamMeta]) -> int:
    """Reproducible mode's pending records among ``records``: their fixed-point sums added across
    replicas (core/exact.py), per replica group in id order; returns how many."""
    todo = sorted({id(m): m for m in records if m.exact is not None and (m.replica_pending or m in _stored)
                   }.values(), key=lambda m: m.id)
    groups: dict[str, list[ParamMeta]] = {}
    for m in todo:
        m.replica_pending = False
        _pending.discard(m)
        _stored.discard(m)
        groups.setdefault(exact.group_of(m), []).append(m)
    for members in groups.values():
        exact.sum_replicas(members)
    return len(todo)


def _sync_stored(records: list[ParamMeta], bucket_numel: int) -> int:
    """The cross-replica mean of the pending grad shards of ``records`` kept in a ``DiskStore``, in
    id order, buckets of one replica group and grad dtype within the store's reduce share."""
    todo = sorted({id(m): m for m in records if m in _stored}.values(), key=lambda m: m.id)
    groups: dict[tuple, list[tuple[ParamMeta, int]]] = {}
    for m in todo:
        _stored.discard(m)
        if disk.has_grad(m.shard):
            key = (group_key(m.replica), disk.grad_dtype(m.shard), id(disk.store_of_parked(m.shard)))
            groups.setdefault(key, []).append((m, m.layout.shard_numel))
    for (_, dtype, _), items in groups.items():
        limit = min(bucket_numel, disk.store_of_parked(items[0][0].shard).budget.reduce_bytes // dtype.itemsize)
        for run in _chunks(items, max(1, limit)):
            shards = [m.shard for m, _ in run]
            flat, segments = disk.read_grads(shards)  # one buffer: a single all-reduce
            _mean(flat, [m for m, _ in run], [g.view(-1) for g in segments])
            disk.write_grads(shards, segments)
    return len(todo)


def _take(records: Iterable[ParamMeta]) -> list[ParamMeta]:
    """The pending ones of ``records`` in id order (the same on every replica), no longer pending."""
    todo = sorted({id(m): m for m in records if m.replica_pending}.values(), key=lambda m: m.id)
    for m in todo:
        m.replica_pending = False
        _pending.discard(m)
    return todo


def _buckets(todo: list[ParamMeta], bucket_numel: int) -> Iterable[list[tuple[ParamMeta, torch.Tensor]]]:
    """``(record, grad shard)`` runs of one replica group, dtype and device, at most ``bucket_numel``
    elements each (records without a grad shard left out)."""
    groups: dict[tuple, list[tuple[ParamMeta, torch.Tensor]]] = {}
    for m in todo:
        grad = _grad_of(m)
        if grad is not None:
            groups.setdefault((group_key(m.replica), grad.dtype, grad.device), []).append((m, grad))
    for items in groups.values():
        yield from _chunks(items, bucket_numel)


def _grad_of(m: ParamMeta) -> Any:
    """``m``'s grad shard in memory (a stored one is averaged by ``_sync_stored``)."""
    return None if disk.has_grad(m.shard) else m.grad_shard


def _chunks(items: list, limit: int) -> Iterable[list]:
    """``items`` (``(record, grad or its numel)``) in runs of at most ``limit`` elements (one larger
    grad is a run of its own)."""
    run, size = [], 0
    for item in items:
        n = item[1] if isinstance(item[1], int) else item[1].numel()
        if run and size + n > limit:
            yield run
            run, size = [], 0
        run.append(item)
        size += n
    if run:
        yield run


def _keys(records: list[ParamMeta]) -> list[tuple]:
    """The error-feedback keys of a compressed cross-replica mean: one per parameter, whatever
    the bucket it goes in (the codes are made per parameter: buckets do not change the result)."""
    return [("replica", m.id) for m in records]


def _mean(flat: torch.Tensor, records: list[ParamMeta], views: list[torch.Tensor]) -> None:
    """``flat`` (the packed grads of ``records``, one replica group; ``views``: each one's 1-D
    view of it) replaced by its mean across replicas."""
    info, codec = records[0].replica, replica_codec(records[0])
    with torch.no_grad():
        if codec is not None:  # as codes, error feedback per parameter
            all_reduce_mean_quantized(views, info, codec, records[0].compression.feedback, _keys(records))
        else:
            all_reduce(flat, info)
            flat.div_(info.world_size)


def _all_reduce_mean(items: list[tuple[ParamMeta, torch.Tensor]]) -> None:
    """One all-reduce of the grads of ``items`` (packed), divided by the replica count, copied back."""
    grads = [g for _, g in items]
    with torch.no_grad():
        flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1).clone()
        _mean(flat, [m for m, _ in items], list(flat.split([g.numel() for g in grads])))
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()


class InFlight:
    """Cross-replica all-reduces issued while backward goes on (``set_replica_sync(model,
    "backward")``): ``start`` issues the all-reduce of the grad shards that just landed without
    waiting, so it runs while backward computes: in place when they lie side by side in one
    buffer (the reduce-scatter's, ``core/grads.py``), else on a packed copy; ``finish`` (at the
    backward's end) waits and leaves the means in the grad shards. A grad shard that is about
    to receive more while in flight (``mark_pending`` runs before the add) has its all-reduce
    finished first: the new part lands on the mean, replica-local, pending for a later sync."""

    def __init__(self) -> None:
        self._runs: list[list] = []  # [work, flat, items, in place, divide]; work None once finished

    def start(self, records: Iterable[ParamMeta], bucket_numel: int = BUCKET_NUMEL) -> None:
        """Issue the all-reduce of the pending grad shards of ``records`` (no longer pending)."""
        plain = [m for m in records if m not in _flying]  # one in flight that receives more: its rest later
        for chunk in _buckets(_take(plain), bucket_numel):
            region = _one_region([g for _, g in chunk])
            flat = region if region is not None else torch.cat([g.reshape(-1) for _, g in chunk])
            first, codec = chunk[0][0], replica_codec(chunk[0][0])
            work = (all_reduce_async(flat, first.replica) if codec is None else  # as codes: the mean itself
                    all_reduce_mean_quantized(flat.split([g.numel() for _, g in chunk]), first.replica, codec,
                                              first.compression.feedback, _keys([m for m, _ in chunk]), True))
            run = [work, flat, chunk, region is not None, codec is None]
            self._runs.append(run)
            for m, _ in chunk:
                _flying[m] = run

    def finish(self) -> None:
        """Wait for every all-reduce issued, leave the means in the grad shards."""
        runs, self._runs = self._runs, []
        for run in runs:
            _complete(run)


def _complete(run: list) -> None:
    """Wait for one all-reduce in flight, divide, write the means back (once)."""
    work, flat, items, in_place, divide = run
    if work is None:
        return
    run[0] = None
    work.wait()
    for m, _ in items:
        _flying.pop(m, None)
    with torch.no_grad():
        if divide:
            flat.div_(items[0][0].replica.world_size)
        if not in_place:
            torch.split_with_sizes_copy(flat, [g.numel() for _, g in items], out=[g.view(-1) for _, g in items])


def _one_region(grads: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """One 1-D tensor over the memory of ``grads`` if they lie side by side in it, in order."""
    first, end = grads[0], grads[0].data_ptr()
    storage = first.untyped_storage()
    for g in grads:
        if not g.is_contiguous() or g.data_ptr() != end or g.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        end += g.numel() * g.element_size()
    total = sum(g.numel() for g in grads)
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, first.storage_offset(), (total,))


def _before_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """Sync the pending grad shards among the tensors ``optimizer`` steps (its shards)."""
    if not _pending and not _stored:
        return
    held = {id(t) for t in steps.held_tensors(optimizer)}
    mine = [m for m in [*_pending, *_stored] if id(m.shard) in held]
    if mine:
        sync_replica_grads(mine)
