"""Gather and release sharded parameters (one group of all-gathers per call, no copies), and
``gathered``: full parameters inside a ``with`` block.

``gather`` all-gathers the shard of every requested parameter (sorted by id, so all ranks
issue the same sequence) straight into the storage of its full tensor: the shard is the
send buffer and the padded full tensor (``world_size * shard_numel`` elements, the param
a view of its first ``numel``) the receive buffer, so nothing is packed or unpacked. The
collectives of one call are issued back to back and counted as one call. With a
``StoragePool`` (``pool=``), ``release(..., free_storage=True)`` hands the freed memory to
the pool and ``gather`` takes blocks of the right byte size from it before allocating.

Fetch is idempotent: AVAILABLE params are skipped, INFLIGHT params are not requested
again, their pending handle is joined. An AVAILABLE param whose shard changed since it
was gathered (``is_stale``: an optimizer stepped the shard while the param stayed
gathered) is fetched again, so a gather never hands out stale values. (Every rank must see the
same shards change, as with any optimizer that
steps all ranks' shards, or the ranks would disagree on the collective.)
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from parts.base.storage_pool import StoragePool
from parts.comm import GroupArg, GroupInfo, all_gather_many, all_gather_quantized
from parts.comm.compressed import Codec, all_gather_rows
from parts.partition.core import disk
from parts.partition.core.compression import keeps_codes, weight_codec
from parts.partition.core.param import (ParamMeta, ParamStatus, alloc, common_info, empty_like_released,
                                   internal, is_partitioned, is_stale, meta, metas_sorted, stamp,
                                   wanted_dtype)
from parts.partition.core.sharding import reshard

Pairs = list[tuple[nn.Parameter, ParamMeta]]


class GatherHandle:
    """A pending gather: ``wait()`` unpacks the full tensors (idempotent) and joins others."""

    def __init__(self, pairs: Pairs, work: Any = None, unpack: Any = None,
                 joined: Iterable["GatherHandle"] = ()) -> None:
        self._pairs, self._work, self._unpack = pairs, work, unpack
        self._joined = [h for h in joined if h is not self]
        self._done = False

    @property
    def done(self) -> bool:
        """True once ``wait()`` has completed."""
        return self._done

    @internal
    def wait(self) -> None:
        """Wait for the collective, fill ``p.data`` of every fetched param, wait joined handles."""
        if self._done:
            return
        self._done = True
        if self._work is not None:
            self._work.wait()
        if self._unpack is not None:
            self._unpack()
        for p, m in self._pairs:
            m.status, m.handle = ParamStatus.AVAILABLE, None
        for h in self._joined:
            h.wait()


def _launch(pairs: Pairs, info: GroupInfo, async_op: bool, pool: Optional[StoragePool],
            joined: Iterable[GatherHandle], compute: bool,
            sources: Optional[list[torch.Tensor]] = None, codec: Optional[Codec] = None) -> GatherHandle:
    """Start the all-gather of every shard straight into its full tensor; the handle finishes.
    With ``compute`` each shard is cast to its policy's compute dtype *before* the collective,
    so the wire carries (and the full tensor holds) that dtype. ``sources``: what each rank
    sends instead of its shard (``gather_from``; with ``codec``, rows of codes)."""
    sends, fulls, parked = [], [], []
    records = [m for _, m in pairs]
    codec = weight_codec(records, info) if compute and sources is None else codec
    codes: Optional[list] = [] if sources is None and codec is not None and keeps_codes(records) else None
    for k, (p, m) in enumerate(pairs):
        current = p.data if m.status is ParamStatus.AVAILABLE else None  # a stale one: refill it
        stamp(m)  # the full tensor will hold the shards as sent now
        dtype = m.full_dtype = wanted_dtype(m, compute)
        m.full_codes = codec is not None
        if sources is not None:
            sends.append(sources[k])
        else:
            if disk.load_for_send(m.shard):
                parked.append(m.shard)
            shard = m.shard
            sent = shard.dtype if codec is not None else dtype  # codes are made from the fp32 master
            sends.append(shard if shard.dtype == sent and shard.device == m.device
                         else disk.to_device(shard, m.device, sent))
        full = _full_for(m, pool, dtype, current)
        fulls.append(full if full[0] is not current else (None, full[1]))  # refilled in place: as is
    outs = [flat for _, flat in fulls]
    if codec is None:
        work = all_gather_many(outs, sends, info, async_op=async_op)
    elif sources is None:
        work = all_gather_quantized(outs, sends, info, codec, async_op, keep=codes)
    else:
        work = all_gather_rows(outs, sends, [m.layout.shard_numel for m in records], info, codec, async_op)

    def unpack() -> None:
        for shard in parked:
            disk.after_send(shard)
        for k, ((p, m), (full, _)) in enumerate(zip(pairs, fulls)):
            if codes:  # every rank's codes of the parameter, for its secondary shard
                m.full_codes = codes[k]
            if full is not None:
                p.data = full
                m.full_ptr, m.in_flat = full.untyped_storage().data_ptr(), False

    return GatherHandle(pairs, work, unpack, joined)


def _full_for(m: ParamMeta, pool: Optional[StoragePool], dtype: torch.dtype,
              current: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The full ``dtype`` tensor for ``m`` (``current``, the stale full tensor of a gathered
    param, refilled in place; its freed storage refilled, from ``pool`` if it has a block that
    size; else fresh) and its padded 1-D alias of ``world_size * shard_numel`` elements,
    which the all-gather writes."""
    padded = m.world_size * m.layout.shard_numel
    nbytes = padded * dtype.itemsize
    if (current is not None and current.dtype == dtype and _owns_storage(current, m)
            and current.untyped_storage().nbytes() >= nbytes):
        storage = current.untyped_storage()
        return current, torch.empty(0, dtype=dtype, device=m.device).set_(storage, 0, (padded,))
    kept, m.shrunk = m.shrunk, None
    if kept is not None and kept.dtype != dtype:
        kept = None  # gathered in another dtype before: views saved from it cannot be refilled
    if kept is None:
        flat = _from_pool(pool, nbytes, dtype, m.device) if pool is not None else None
        flat = alloc(padded, dtype, m.device) if flat is None else flat
        return flat[:m.numel].view(m.shape), flat
    storage = kept.untyped_storage()
    if pool is None:
        storage.resize_(nbytes)
    else:
        pool.fill(storage, nbytes)
    # A separate tensor on the same storage: writing through it leaves the version counter
    # of the views autograd saved from ``kept`` untouched (they must see the new values).
    alias = torch.empty(0, dtype=dtype, device=m.device).set_(storage, 0, (padded,))
    return kept, alias


def _from_pool(pool: StoragePool, nbytes: int, dtype: torch.dtype,
               device: torch.device) -> Optional[torch.Tensor]:
    """A 1-D tensor of ``nbytes`` on a cached block of ``pool``, or None if it has none."""
    storage = pool.take(nbytes, device)
    if storage is None:
        return None
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (nbytes // dtype.itemsize,))


@internal
def gather(params: Iterable[nn.Parameter], group: GroupArg = None, async_op: bool = False,
           pool: Optional[StoragePool] = None, compute: bool = False) -> Optional[GatherHandle]:
    """Make ``params`` full (``p.data`` gets the global tensor) with one group of all-gathers;
    storage freed by ``release(..., pool=pool)`` is refilled from ``pool`` when it can be.

    ``compute``: gather in each param's compute dtype (``MixedPrecision``, set by ``attach``);
    otherwise in the shard's dtype (full precision). A param available in the other dtype is
    gathered again, and so is one holding a compressed gather's values when ``compute`` is off."""
    pairs = metas_sorted(params)
    info = common_info(pairs, group, "gather")
    todo = [(p, m) for p, m in pairs if m.status is ParamStatus.NOT_AVAILABLE or is_stale(m)
            or (m.status is ParamStatus.AVAILABLE and m.full_dtype not in (None, wanted_dtype(m, compute)))
            or (m.status is ParamStatus.AVAILABLE and m.full_codes and not compute)]  # masters wanted
    joined = {id(m.handle): m.handle for _, m in pairs
              if m.status is ParamStatus.INFLIGHT and m.handle is not None}
    handle = GatherHandle([], joined=joined.values())
    if todo:
        handle = _launch(todo, info, async_op, pool, joined.values(), compute)
    return _in_flight(handle, todo, async_op)


@internal
def gather_from(params: list[nn.Parameter], sources: list[torch.Tensor], info: GroupInfo,
                async_op: bool = False, pool: Optional[StoragePool] = None,
                codec: Optional[Codec] = None) -> Optional[GatherHandle]:
    """Make the released ``params`` full (in their compute dtype) from ``sources[k]``, this rank's
    block of ``params[k]``'s padded full tensor over ``info``, a subgroup whose members hold the
    other blocks (the coordinator's node-local secondary shards): one group of all-gathers, in
    the order given (the same on every member); the full tensors hold the bytes ``gather`` gives.
    With ``codec`` each block is the codes of its shards (wire rows of a compressed gather)."""
    pairs = [(p, meta(p)) for p in params]
    for _, m in pairs:
        if m.status is not ParamStatus.NOT_AVAILABLE:
            raise RuntimeError(f"gather_from: {m.describe()} is {m.status.value}, not released")
    return _in_flight(_launch(pairs, info, async_op, pool, (), True, sources, codec), pairs, async_op)


def _in_flight(handle: GatherHandle, pairs: list, async_op: bool) -> Optional[GatherHandle]:
    """Mark ``pairs``' records in flight on ``handle``; wait for it unless ``async_op``."""
    for _, m in pairs:
        m.status, m.handle = ParamStatus.INFLIGHT, handle
    if not async_op:
        handle.wait()
        return None
    return handle


@internal
def padded_full(p: nn.Parameter) -> Optional[torch.Tensor]:
    """The 1-D padded full tensor (``world_size * shard_numel`` elements) a gather filled for ``p``,
    None if ``p`` is not gathered or its data is not that tensor (a flat buffer's view)."""
    m = meta(p)
    if m.status is not ParamStatus.AVAILABLE or not _owns_storage(p.data, m):
        return None
    padded = m.world_size * m.layout.shard_numel
    storage = p.data.untyped_storage()
    if storage.nbytes() < padded * p.data.element_size():
        return None
    return torch.empty(0, dtype=p.data.dtype, device=p.data.device).set_(storage, 0, (padded,))


@internal
def release(params: Iterable[nn.Parameter], free_storage: bool = False,
            pool: Optional[StoragePool] = None) -> None:
    """Drop the full tensors of ``params`` (status NOT_AVAILABLE); waits an in-flight gather first.

    With ``free_storage`` the full tensor's storage is also emptied to 0 bytes (and refilled
    by the next ``gather``), so views autograd saved in forward hold no memory meanwhile;
    a backward through such a view must gather the parameter first (the coordinator does).
    Its memory goes to ``pool`` (for the next gather of that size) if given, else is freed.
    """
    for p, m in metas_sorted(params):
        if m.status is ParamStatus.INFLIGHT and m.handle is not None:
            m.handle.wait()
        if m.status is ParamStatus.NOT_AVAILABLE:
            continue
        if free_storage and _owns_storage(p.data, m):
            m.shrunk = p.data
            _empty_storage(p.data.untyped_storage(), pool)
        p.data = empty_like_released(m.dtype, m.device)
        m.status, m.handle, m.full_dtype, m.in_flat = ParamStatus.NOT_AVAILABLE, None, None, False
        m.full_codes = False


def _owns_storage(data: torch.Tensor, m: ParamMeta) -> bool:
    """True if ``data`` is the full tensor ``gather`` made for ``m`` (nobody else's storage)."""
    return (m.numel > 0 and not m.in_flat and data.shape == m.shape
            and data.untyped_storage().data_ptr() == m.full_ptr
            and data.storage_offset() == 0 and data.is_contiguous())


def _empty_storage(storage: torch.UntypedStorage, pool: Optional[StoragePool]) -> None:
    """Leave ``storage`` with 0 bytes: its memory goes to ``pool`` if it takes it, else is freed."""
    if pool is None:
        storage.resize_(0)
    else:
        pool.give(storage)


@contextlib.contextmanager
def gathered(params: Iterable[nn.Parameter], modifier_rank: Optional[int] = None) -> Iterator[None]:
    """Full ``params`` inside the block; re-sharded from ``modifier_rank`` on exit (else discarded).

    On entry the params are gathered (one collective; those already AVAILABLE are kept as
    they are, unless their shard changed since they were gathered: those are fetched again). On normal exit:

    * with ``modifier_rank=r``: rank ``r``'s full values are broadcast and re-sharded, so
      every rank's shard (and the full tensor of params that stay available) hold them;
    * without it: changes are discarded. Params gathered on entry are released; params
      that were already AVAILABLE stay AVAILABLE and get back the values they had on entry
      (a copy is kept for the block), so a nested block cannot undo an outer one's writes.

    Params that were AVAILABLE before stay AVAILABLE after, which makes nesting safe. If
    the block raises, no collective is issued on the way out (the other ranks may not be
    there): params gathered on entry are released, the others left as they are.
    """
    params = [params] if isinstance(params, nn.Parameter) else list(params)
    pairs = metas_sorted(p for p in params if is_partitioned(p))
    if pairs and modifier_rank is not None and not 0 <= modifier_rank < pairs[0][1].world_size:
        raise ValueError(f"gathered: modifier_rank={modifier_rank} is outside the group of "
                         f"{pairs[0][1].world_size} ranks")
    before = [(p, m) for p, m in pairs if m.status is ParamStatus.AVAILABLE]
    ours = [(p, m) for p, m in pairs if m.status is not ParamStatus.AVAILABLE]
    gather([p for p, _ in pairs])  # also refreshes AVAILABLE params whose shard changed
    saved = [p.data.clone() for p, _ in before] if modifier_rank is None else []
    try:
        yield
    except BaseException:
        release([p for p, _ in ours])
        raise
    with internal:
        if modifier_rank is not None:
            reshard(pairs, modifier_rank, keep=True)
        else:
            for (p, _), value in zip(before, saved):
                p.data.copy_(value)
        release([p for p, _ in ours])
