"""Gather and release sharded parameters: one coalesced all-gather per call.

``gather`` packs the shards of every requested parameter (sorted by id, so all ranks
agree on the layout) into one flat send buffer with ``parts.csrc.copy_in``, all-gathers
it, and unpacks the full tensors with ``parts.csrc.copy_out``. Parameters of several
dtypes travel in one byte buffer. Fetch is idempotent: AVAILABLE params are skipped,
INFLIGHT params are not requested again, their pending handle is joined. An AVAILABLE
param whose shard changed since it was gathered (``is_stale``: an optimizer stepped the
shard while the param stayed gathered) is fetched again, so a gather never hands out
stale values. (Every rank must see the same shards change, as with any optimizer that
steps all ranks' shards, or the ranks would disagree on the collective.)
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Optional

import torch
from torch import nn

from parts import csrc
from parts.partition._collectives import GroupInfo, all_gather
from parts.partition.param import (ParamMeta, ParamStatus, alloc, common_info, empty_like_released,
                                   internal, is_stale, metas_sorted, stamp)

__all__ = ["GatherHandle", "gather", "release"]

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


def _unit_dtype(pairs: Pairs) -> torch.dtype:
    """The element type of the flat buffer: the params' dtype, or bytes if they differ."""
    dtypes = {m.dtype for _, m in pairs}
    return dtypes.pop() if len(dtypes) == 1 else torch.uint8


def _as_units(t: torch.Tensor, unit: torch.dtype) -> torch.Tensor:
    """1-D view of contiguous ``t`` in ``unit`` elements."""
    flat = t.reshape(-1)
    return flat if flat.dtype == unit else flat.view(unit)


def _plan(pairs: Pairs, unit: torch.dtype) -> tuple[list[int], list[int], int]:
    """Per-param shard sizes and offsets (in units) inside one rank's chunk, and the chunk size."""
    scale = [1 if unit == m.dtype else m.dtype.itemsize for _, m in pairs]
    sizes = [m.layout.shard_numel * s for (_, m), s in zip(pairs, scale)]
    offsets = list(itertools.accumulate([0] + sizes[:-1]))
    return sizes, offsets, sum(sizes)


def _launch(pairs: Pairs, info: GroupInfo, async_op: bool) -> GatherHandle:
    """Pack shards, start the all-gather, return the handle that unpacks."""
    device, unit = pairs[0][1].device, _unit_dtype(pairs)
    sizes, offsets, chunk = _plan(pairs, unit)
    send = alloc(chunk, unit, device)
    for _, m in pairs:
        stamp(m)  # the full tensor will hold the shards as packed now
    csrc.copy_in([_as_units(m.shard.to(device, non_blocking=True), unit) for _, m in pairs],
                 send, offsets)
    recv = alloc(chunk * info.world_size, unit, device)
    work = all_gather(recv, send, info, async_op=async_op)

    def unpack() -> None:
        fulls = [_full_for(m) for _, m in pairs]
        csrc.copy_out(recv, [_as_units(flat, unit) for _, flat in fulls], info.world_size, offsets, sizes)
        for (p, m), (full, _) in zip(pairs, fulls):
            p.data = full
            m.full_ptr = full.untyped_storage().data_ptr()

    return GatherHandle(pairs, work, unpack)


def _full_for(m: ParamMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """The full tensor to fill for ``m`` (its freed storage refilled, else fresh) and a 1-D alias."""
    kept, m.shrunk = m.shrunk, None
    if kept is None:
        flat = alloc(m.numel, m.dtype, m.device)
        return flat.view(m.shape), flat
    storage = kept.untyped_storage()
    storage.resize_(m.numel * m.dtype.itemsize)
    # A separate tensor on the same storage: writing through it leaves the version counter
    # of the views autograd saved from ``kept`` untouched (they must see the new values).
    alias = torch.empty(0, dtype=m.dtype, device=m.device).set_(storage, 0, (m.numel,))
    return kept, alias


@internal
def gather(params: Iterable[nn.Parameter], group: Any = None, async_op: bool = False) -> Optional[GatherHandle]:
    """Make ``params`` full (``p.data`` gets the global tensor) with one coalesced all-gather."""
    pairs = metas_sorted(params)
    info = common_info(pairs, group, "gather")
    todo = [(p, m) for p, m in pairs if m.status is ParamStatus.NOT_AVAILABLE or is_stale(m)]
    joined = {id(m.handle): m.handle for _, m in pairs
              if m.status is ParamStatus.INFLIGHT and m.handle is not None}
    handle = GatherHandle([], joined=joined.values())
    if todo:
        handle = _launch(todo, info, async_op)
        handle._joined = list(joined.values())
        for _, m in todo:
            m.status, m.handle = ParamStatus.INFLIGHT, handle
    if not async_op:
        handle.wait()
        return None
    return handle


@internal
def release(params: Iterable[nn.Parameter], free_storage: bool = False) -> None:
    """Drop the full tensors of ``params`` (status NOT_AVAILABLE); waits an in-flight gather first.

    With ``free_storage`` the full tensor's storage is also resized to 0 bytes (and refilled
    by the next ``gather``), so views autograd saved in forward hold no memory meanwhile;
    a backward through such a view must gather the parameter first (the coordinator does).
    """
    for p, m in metas_sorted(params):
        if m.status is ParamStatus.INFLIGHT and m.handle is not None:
            m.handle.wait()
        if m.status is ParamStatus.NOT_AVAILABLE:
            continue
        if free_storage and _owns_storage(p.data, m):
            m.shrunk = p.data
            p.data.untyped_storage().resize_(0)
        p.data = empty_like_released(m.dtype, m.device)
        m.status, m.handle = ParamStatus.NOT_AVAILABLE, None


def _owns_storage(data: torch.Tensor, m: ParamMeta) -> bool:
    """True if ``data`` is the full tensor ``gather`` made for ``m`` (nobody else's storage)."""
    return (m.numel > 0 and data.shape == m.shape and data.untyped_storage().data_ptr() == m.full_ptr
            and data.storage_offset() == 0 and data.is_contiguous())
