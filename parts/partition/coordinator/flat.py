"""Persistent parameters in flat buffers: one all-gather and one reduce-scatter per step for all.

Persistent parameters (fewer elements than ``persistence_threshold``) stay gathered, but an
optimizer step changes their shards, so each training step begins by gathering them again,
and each backward reduce-scatters their grads. Done one parameter at a time, a model with
hundreds of small parameters pays tens of µs of Python per parameter and step, more than the
bytes cost. Here the persistent parameters of one dtype and device (shards in memory, not on
disk) are handled as one:

* ``FlatGather``: their full tensors are views of one flat buffer (parameter after
  parameter, each padded to ``world * shard_numel``). A refresh is one all-gather of the
  concatenated shards and one native copy into the views (``split_with_sizes_copy``); no
  parameter is touched one by one. Whether a refresh is needed is one comparison of two
  version lists (``memory_versions``): a step after which no shard changed gathers nothing.
* ``FlatReduce``: their full grads wait in ``p.grad`` (no hook work per parameter but
  noting that a backward runs); when backward ends, one native copy packs them rank by rank
  into one send buffer, one reduce-scatter sums it, and the reduced slices land in one flat
  grad-shard buffer whose views are the grad shards (while they accumulate over
  micro-batches, one ``add_``).

The results are bitwise those of the per-parameter path (the same elements summed in the
same rank order, the same bytes counted). Whatever this does not cover (a parameter released
or gathered again elsewhere, held by a running module, a shard replaced, a parameter without
a grad this backward) goes the per-parameter way for that step.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch
from torch import nn

from parts.comm import all_gather_many, all_gather_quantized, comm_counter, reduce_scatter_many
from parts.partition.coordinator.plan import collective_bytes
from parts.partition.coordinator.table import ParamTable
from parts.partition.core import disk
from parts.partition.core.compression import compressed_grads, gather_wire_bytes, reduce_compressed, weight_codec
from parts.partition.core.grad_guard import as_grad_shard, internal, raw_grad
from parts.partition.core.grad_guard import set_raw_grad as _set_grad
from parts.partition.core.grads import accumulate_into, grad_dtype
from parts.partition.core.replicas import mark_pending
from parts.partition.core.param import (ParamMeta, ParamStatus, alloc, memory_versions, wanted_dtype,
                                        watch_shards)

CURRENT, REFILL, INSTALL, FALLBACK = "current", "refill", "install", "fallback"
_AVAILABLE = ParamStatus.AVAILABLE


def offsets_of(sizes: list[int]) -> list[int]:
    """Start of each of ``sizes`` laid side by side."""
    return list(itertools.accumulate([0] + sizes[:-1])) if sizes else []


def _flat_ids(table: ParamTable) -> list[int]:
    """Persistent ids whose shards can live in one flat group: in memory with a version
    counter, of the first such record's group, dtypes and device."""
    out, key = [], None
    for pid in table.persistent_ids:
        m = table.records[pid]
        if m.numel == 0 or disk.parked_version(m.shard) is not None or m.shard.is_inference():
            continue
        this = (m.info.group, m.shard.dtype, wanted_dtype(m, True), m.device, m.shard.device)
        key = this if key is None else key
        if this == key:
            out.append(pid)
    return out


class FlatGather:
    """The full tensors of the flat persistent parameters: one buffer, one all-gather."""

    def __init__(self, table: ParamTable) -> None:
        self.pids = _flat_ids(table)
        chosen = set(self.pids)
        self.others = [pid for pid in table.persistent_ids if pid not in chosen]
        self.params: list[nn.Parameter] = table.select(self.pids)
        self.records: list[ParamMeta] = [table.records[pid] for pid in self.pids]
        self.full: Optional[torch.Tensor] = None
        self._scratch: Optional[torch.Tensor] = None
        self._outs: list[torch.Tensor] = []  # the buffer's rows per parameter (set by _allocate)
        self._views: list[torch.Tensor] = []  # each parameter's full view of the buffer
        self.ptrs: list[int] = []
        self.broken = not self.pids
        if self.broken:
            return
        first = self.records[0]
        self.info, self.world, self.device = first.info, first.world_size, first.device
        self.dtype = wanted_dtype(first, True)
        self.cast = first.shard.dtype != self.dtype or first.shard.device != self.device
        self.sizes = [m.layout.shard_numel for m in self.records]
        wire = gather_wire_bytes(self.records, self.info)  # codes: what travels (core/compression.py)
        self.nbytes = wire or [collective_bytes(s, self.world, self.dtype.itemsize) for s in self.sizes]
        watch_shards(self.records)
        self.shard_ids = [id(m.shard) for m in self.records]

    def placed(self) -> bool:
        """True if every flat parameter's full tensor is its view of the buffer."""
        return (self.full is not None and all(m._status is _AVAILABLE and m.in_flat for m in self.records)
                and [p.data_ptr() for p in self.params] == self.ptrs)

    def decide(self, uses: dict) -> str:
        """What a step's start needs: CURRENT (nothing), REFILL (the buffer in place), INSTALL
        (a new buffer, the views put in place) or FALLBACK (the per-parameter way)."""
        if self.broken:
            return FALLBACK
        if [id(m.shard) for m in self.records] != self.shard_ids:
            self.broken = True  # a shard was replaced (another dtype, device): per parameter from now on
            return FALLBACK
        placed = self.placed()
        if placed and memory_versions(self.records) == [m.full_version for m in self.records]:
            return CURRENT
        if any(uses.get(pid) for pid in self.pids) or any(m._status is ParamStatus.INFLIGHT
                                                          for m in self.records):
            return FALLBACK
        return REFILL if placed else INSTALL

    @internal
    def gather(self, how: str) -> None:
        """All-gather every flat shard into the buffer (a new one for INSTALL) in one collective."""
        versions = memory_versions(self.records)  # the shards as sent
        codec = weight_codec(self.records, self.info)
        if codec is not None:  # codes of each shard, dequantized straight into the buffer's rows
            if how == INSTALL:
                self._allocate()
            with torch.no_grad():
                all_gather_quantized([o.view(-1) for o in self._outs], [m.shard.to(self.device) for m in self.records],
                                     self.info, codec)
        else:
            self._gather_full(how)
        if how == INSTALL:
            self._place()
        for m, version in zip(self.records, versions):
            m.full_version, m.full_codes = version, codec is not None

    def _gather_full(self, how: str) -> None:
        """The shards (cast to the full dtype) into the buffer's rows by one all-gather."""
        buf = self.scratch()
        rows = buf.view(self.world, -1)
        own = rows[self.info.rank]
        with torch.no_grad():
            shards = [m.shard for m in self.records]
            if self.cast:
                own.copy_(torch.cat(shards))
            else:
                torch.cat(shards, out=own)
        if how == INSTALL:
            self._allocate()
        all_gather_many([buf], [own], self.info)
        torch.split_with_sizes_copy(rows, self.sizes, dim=1, out=self._outs)

    def scratch(self) -> torch.Tensor:
        """One kept buffer of ``world * sum(shard_numel)`` elements of the full dtype: the refresh
        receives into it (its own row is the send buffer) and the grads are packed into it to
        be reduce-scattered; the two never overlap, and nothing is allocated afresh each step."""
        if self._scratch is None:
            self._scratch = alloc(self.world * sum(self.sizes), self.dtype, self.device)
        return self._scratch

    def _allocate(self) -> None:
        padded = [self.world * s for s in self.sizes]
        self.full = alloc(sum(padded), self.dtype, self.device)
        starts = offsets_of(padded)
        self._outs = [self.full[o:o + n].view(self.world, s) for o, n, s in zip(starts, padded, self.sizes)]
        self._views = [self.full[o:o + m.numel].view(m.shape) for o, m in zip(starts, self.records)]
        self.ptrs = [v.data_ptr() for v in self._views]

    def _place(self) -> None:
        """Every flat parameter's ``p.data`` becomes its view of the buffer (status AVAILABLE)."""
        ptr = self.full.untyped_storage().data_ptr()
        for p, m, view in zip(self.params, self.records, self._views):
            p.data = view
            m.status, m.handle, m.shrunk = _AVAILABLE, None, None
            m.full_ptr, m.full_dtype, m.in_flat = ptr, self.dtype, True


class FlatReduce:
    """The grads of the flat persistent parameters that require grad: one reduce-scatter for all.

    Which ones require grad is read again at every backward's start (``follow``): a parameter
    frozen or unfrozen between steps leaves or joins the one reduce-scatter. Every rank reads
    the same flags (``requires_grad`` is set alike on every rank, as for DDP), so every rank
    packs the same parameters at the same offsets; ``debug`` checks it, naming a parameter.
    """

    def __init__(self, flat: FlatGather, reduce_dtype: torch.dtype) -> None:
        self.flat = flat
        shard_dtype = flat.records[0].shard.dtype if flat.records else reduce_dtype
        self.reduce_dtype = grad_dtype(shard_dtype, reduce_dtype)  # float64 shards: float64 grads
        self._flags: Optional[tuple] = None
        self._grads: list[torch.Tensor] = []
        self.params: list[nn.Parameter] = []  # the members (requiring grad) and what follows of them
        self.records: list[ParamMeta] = []
        self.pids: list[int] = []
        self.index: dict[int, int] = {}
        self.grad_shards: Optional[torch.Tensor] = None
        self.shard_grads: list[torch.Tensor] = []
        self.sizes: list[int] = []
        self.even: list[bool] = []
        self.same_dtype = True
        self.follow()

    def follow(self) -> bool:
        """Take the flat parameters requiring grad now as the members; True if they changed."""
        flat = self.flat
        flags = () if flat.broken else tuple(p.requires_grad for p in flat.params)
        if flags == self._flags:
            return False
        self._flags = flags
        keep = [k for k, trainable in enumerate(flags) if trainable]
        self.params = [flat.params[k] for k in keep]
        self.records = [flat.records[k] for k in keep]
        self.pids = [flat.pids[k] for k in keep]
        self.index = {id(p): k for k, p in enumerate(self.params)}
        self.grad_shards, self.shard_grads = None, []
        self.sizes = [m.layout.shard_numel for m in self.records]
        self.even = [m.numel == m.world_size * s for m, s in zip(self.records, self.sizes)]  # no padding
        self.same_dtype = all(m.shard.dtype == self.reduce_dtype for m in self.records)
        return True

    def ready(self) -> bool:
        """True if every parameter has a full grad of its shape and the buffer's dtype (else the
        per-parameter path reduces what there is)."""
        if not self.params or self.flat.broken:
            return False
        grads = [raw_grad(p) for p in self.params]
        dtype = self.flat.dtype
        if all(g is not None and g.dtype == dtype and g.shape == m.shape for g, m in zip(grads, self.records)):
            self._grads = grads
            return True
        return False

    @internal
    def reduce(self) -> None:
        """One reduce-scatter (mean over ranks) of every grad, packed rank by rank into one send
        buffer, into the grad shards; the grads are consumed (``p.grad`` None)."""
        flat, world = self.flat, self.flat.world
        grads, self._grads = self._grads, []
        send = flat.scratch()[:world * sum(self.sizes)]  # the members only: frozen ones send nothing
        with torch.no_grad():
            rows = [g.detach().reshape(world, s) if even else _padded_rows(g.detach(), world, s)
                    for g, s, even in zip(grads, self.sizes, self.even)]
            torch.cat(rows, dim=1, out=send.view(world, -1))
        del rows, grads
        for p in self.params:
            _set_grad(p, None)
        if torch.promote_types(send.dtype, self.reduce_dtype) != self.reduce_dtype:
            send = send.to(self.reduce_dtype)
        recv = alloc(sum(self.sizes), self.reduce_dtype, flat.device)
        if compressed_grads(self.records, flat.info):  # one residual for the buffer (its members' grads)
            reduce_compressed(self.records, [recv], [send], flat.info, [("flat", tuple(self.pids))], True, False)
        else:
            reduce_scatter_many([recv], [send], flat.info, average=True)
        self._land(recv)
        mark_pending(self.records)  # a hybrid layout's cross-replica mean follows (core/replicas.py)

    def _land(self, recv: torch.Tensor) -> None:
        """Add ``recv`` into the grad shards: one op while they are this buffer's views, the
        views themselves where there are none yet, else shard by shard."""
        grads = [m.shard.grad for m in self.records]
        if self.shard_grads and all(g is v for g, v in zip(grads, self.shard_grads)):
            self.grad_shards.add_(recv)
            return
        if self.same_dtype and all(g is None and m._grad is None for g, m in zip(grads, self.records)):
            self.grad_shards = recv
            self.shard_grads = [as_grad_shard(v) for v in torch.split_with_sizes(recv, self.sizes)]
            for m, g in zip(self.records, self.shard_grads):
                m.shard.grad = g
            return
        self.grad_shards, self.shard_grads = None, []
        for m, part in zip(self.records, torch.split_with_sizes(recv, self.sizes)):
            accumulate_into(m, part, True)


def _padded_rows(grad: torch.Tensor, world: int, shard_numel: int) -> torch.Tensor:
    """A full grad as ``world`` rows of ``shard_numel`` (row ``r``: rank ``r``'s slice), zeros after its end."""
    flat = grad.reshape(-1)
    return torch.cat([flat, flat.new_zeros(world * shard_numel - flat.numel())]).view(world, shard_numel)


def reduce_counted(flat: FlatReduce, counters: object) -> None:
    """``flat.reduce()`` counted as one reduce-scatter call and its wire bytes."""
    sent = comm_counter.reduce_scatter_bytes
    counters.reduce_scatter_calls += 1
    flat.reduce()
    counters.reduce_scatter_bytes += comm_counter.reduce_scatter_bytes - sent
