"""Turning full parameters into shards, and full values back into shards.

``shard_params`` is called once per module (right after its ``__init__``) or once per
``partition_module``: all new parameters of the call are packed as bytes into ONE buffer,
broadcast from rank 0 of the group (so every rank starts from rank 0's values, whatever
its seed), and each rank keeps its slice. The next creation-order id travels in the same
buffer, so ids are identical on every rank of the group even in long-lived processes.
``reshard`` does the same for parameters whose full values were changed (``gathered``
with a ``modifier_rank``, init code under ``partitioned``): broadcast from one rank,
copy this rank's slice into the existing shard tensor in place (optimizers keep it).
In a hybrid layout every replica then takes the first replica's values: the ranges whose
checksums differ across the replica group are broadcast, none when the replicas agree
(built from the same seed, loaded from the same weights).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from parts.partition.core import ddp_guard, disk
from parts.comm import GroupInfo, broadcast
from parts.comm.agreeing import broadcast_differing
from parts.base.layout import ShardLayout
from parts.partition.core.param import (ParamMeta, ParamStatus, alloc, attach_meta,
                                   empty_like_released, is_partitioned, stamp)

_ALIGN = 16  # byte alignment of each tensor in a packed byte buffer
_ids = {"next": 0}  # creation-order ids; synchronised from group rank 0 at every shard call


@dataclass(frozen=True)
class ShardSpec:
    """Where and in which dtype shards live (one ``partitioned`` or ``partition_module`` call)."""

    info: GroupInfo
    dtype: Optional[torch.dtype] = None
    device: Optional[torch.device] = None
    remote_device: Optional[Any] = None  # a device, or a parts.offload.DiskStore (partition/core/disk.py)
    pin_memory: bool = False
    replica: Optional[GroupInfo] = None  # a hybrid layout's replica group (shards identical across it)

    def __post_init__(self) -> None:
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise TypeError(f"parts.partition: dtype must be a floating-point torch.dtype or None, "
                            f"got {self.dtype!r}")

    @property
    def on_meta(self) -> bool:
        """True for a build without data (``partitioned(device="meta")``): shapes, layouts and ids only."""
        return self.device is not None and torch.device(self.device).type == "meta"

    def shard_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype ``p`` is stored in: ``dtype`` for floating point params, else unchanged."""
        return self.dtype if self.dtype is not None and p.is_floating_point() else p.dtype

    def compute_device(self, p: torch.Tensor) -> torch.device:
        """Where gathered full tensors live."""
        return torch.device(self.device) if self.device is not None else p.device

    def storage_device(self, p: torch.Tensor) -> torch.device:
        """Where the shard lives (``remote_device``, else the compute device; CPU for a store)."""
        if disk.store_of(self.remote_device) is not None:
            return torch.device("cpu")
        return torch.device(self.remote_device) if self.remote_device is not None else self.compute_device(p)


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _byte_offsets(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Aligned byte offsets of ``tensors`` packed back to back, and the total size."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total = _round_up(total + t.numel() * t.element_size())
    return offsets, total


def _pack_and_release(params: list[nn.Parameter], extra: torch.Tensor,
                      device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Copy params (as bytes) and ``extra`` into one buffer, freeing each full param after copying."""
    offsets, total = _byte_offsets(params)
    buf = alloc(total + extra.numel(), torch.uint8, device)
    for p, off in zip(params, offsets):
        nbytes = p.numel() * p.element_size()
        if nbytes:
            buf[off:off + nbytes].copy_(p.detach().reshape(-1).view(torch.uint8))
        p.data = empty_like_released(p.dtype, p.device)
    buf[total:].copy_(extra)
    return buf, offsets


def write_shard(shard: torch.Tensor, flat: torch.Tensor, layout: ShardLayout, rank: int) -> None:
    """Copy this rank's slice of the full flat ``flat`` into ``shard`` in place; zero its padding."""
    start, stop = layout.range(rank)
    n = stop - start
    with torch.no_grad(), disk.rewrite(shard):
        shard[:n].copy_(flat[start:stop])
        shard[n:].zero_()


def _new_shard(p_flat: torch.Tensor, layout: ShardLayout, spec: ShardSpec, dtype: torch.dtype,
               device: torch.device, compute: torch.device) -> torch.Tensor:
    """This rank's shard in ``device`` memory: pinned host memory where it is asked for, or where
    the shard is in host memory for an accelerator's compute (its copies there run asynchronously)."""
    shard = alloc(layout.shard_numel, dtype, device)
    write_shard(shard, p_flat, layout, spec.info.rank)
    for_accelerator = compute.type not in ("cpu", "meta") and disk.store_of(spec.remote_device) is None
    if (spec.pin_memory or for_accelerator) and device.type == "cpu" and _has_accelerator():
        shard = shard.pin_memory()
    return shard


def _has_accelerator() -> bool:
    acc = getattr(torch, "accelerator", None)
    return bool(acc is not None and acc.is_available())


def shard_params(named: list[tuple[str, nn.Parameter]], spec: ShardSpec) -> list[ParamMeta]:
    """Shard the not-yet-sharded ``(name, param)`` pairs with one broadcast from group rank 0."""
    ddp_guard.install()  # from now on a DDP wrap of a module holding them raises
    todo, seen = [], set()
    for name, p in named:
        if not is_partitioned(p) and id(p) not in seen:
            seen.add(id(p))
            todo.append((name, p))
    if not todo:
        return []
    params = [p for _, p in todo]
    shapes = [p.shape for p in params]
    flats, first_id = _shared_values(params, spec, _ids["next"])
    if spec.replica is not None and not spec.on_meta:
        first_id = _from_first_replica(flats, spec, first_id)
    _ids["next"] = first_id + len(params)
    return [_finish(name, p, flat, shape, first_id + k, spec)
            for k, ((name, p), flat, shape) in enumerate(zip(todo, flats, shapes))]


def _shared_values(params: list[nn.Parameter], spec: ShardSpec, first_id: int) -> tuple[list[torch.Tensor], int]:
    """Rank 0's flat values of ``params`` (which are freed) and rank 0's next id."""
    if spec.info.world_size == 1 or spec.on_meta:  # meta: no values to share; ids agree by construction
        flats = [p.detach().reshape(-1) for p in params]
        for p in params:
            p.data = empty_like_released(p.dtype, p.device)
        return flats, first_id
    dtypes = [p.dtype for p in params]
    numels = [p.numel() for p in params]
    device = spec.compute_device(params[0])  # the collective runs where gathers run
    extra = torch.tensor([first_id], dtype=torch.int64, device=device).view(torch.uint8)
    buf, offsets = _pack_and_release(params, extra, device)
    broadcast(buf, 0, spec.info)
    rank0_id = int(buf[-8:].view(torch.int64).item())
    flats = [buf[off:off + n * dt.itemsize].view(dt) for off, n, dt in zip(offsets, numels, dtypes)]
    return flats, rank0_id


def _from_first_replica(flats: list[torch.Tensor], spec: ShardSpec, first_id: int) -> int:
    """Every replica takes the first replica's values of this rank's shard ranges and its next
    id: replicas start identical, from global rank 0's values, whatever each seeded."""
    return replica_slices(flats, spec.info, spec.replica, first_id)


def replica_slices(flats: list[torch.Tensor], info: GroupInfo, replica: GroupInfo, extra: int = 0) -> int:
    """Overwrite this rank's shard range of each full flat tensor (sharded over ``info``) with
    replica rank 0's, and return its ``extra``: checksums across ``replica``, then one broadcast
    of the ranges that differ (none when the replicas agree)."""
    pieces = []
    for flat in flats:
        start, stop = ShardLayout(flat.numel(), info.world_size).range(info.rank)
        pieces.append(flat[start:stop].view(torch.uint8))
    return broadcast_differing(pieces, replica, extra)


def _finish(name: str, p: nn.Parameter, flat: torch.Tensor, shape: torch.Size, pid: int,
            spec: ShardSpec) -> ParamMeta:
    """Build the record for ``p`` from its full flat values; ``p.data`` stays empty."""
    sdtype, dev, sdev = spec.shard_dtype(p), spec.compute_device(p), spec.storage_device(p)
    layout = ShardLayout(shape.numel(), spec.info.world_size)
    shard = _new_shard(flat, layout, spec, sdtype, sdev, dev)
    if disk.store_of(spec.remote_device) is not None:
        disk.park_shard(shard, spec.remote_device, pid, name)
    record = ParamMeta(name=name, shape=shape, dtype=sdtype, layout=layout, shard=shard,
                       info=spec.info, id=pid, device=dev, init_dtype=flat.dtype, replica=spec.replica)
    p.data = empty_like_released(sdtype, dev)
    attach_meta(p, record)
    return record


def reshard(pairs: list[tuple[nn.Parameter, ParamMeta]], src: int, keep: bool = False) -> None:
    """Broadcast the full ``p.data`` of ``pairs`` from group rank ``src`` and rewrite the shards.

    With ``keep`` the full tensors stay in ``p.data`` (updated to ``src``'s values), else
    they are released. One broadcast per distinct dtype.
    """
    if not pairs:
        return
    info = pairs[0][1].info
    for dtype in sorted({m.dtype for _, m in pairs}, key=str):
        group = [(p, m) for p, m in pairs if m.dtype == dtype]
        _check_full(group)
        numels = [m.numel for _, m in group]
        flat = alloc(sum(numels), dtype, group[0][1].device)
        offs = list(itertools.accumulate([0] + numels[:-1]))
        for (p, _), off, n in zip(group, offs, numels):
            flat[off:off + n].copy_(p.detach().reshape(-1))
        broadcast(flat, src, info)
        replica = group[0][1].replica
        if replica is not None and keep:  # the first replica's values everywhere, full tensors too
            broadcast_differing([flat[off:off + n].view(torch.uint8) for off, n in zip(offs, numels)], replica)
        elif replica is not None:  # the shards only: each rank's slice
            replica_slices([flat[off:off + n] for off, n in zip(offs, numels)], info, replica)
        for (p, m), off, n in zip(group, offs, numels):
            write_shard(m.shard, flat[off:off + n], m.layout, m.rank)
            if keep:
                p.data.copy_(flat[off:off + n].view(m.shape))
                stamp(m)  # full tensor and shard agree again
            else:
                p.data = empty_like_released(m.dtype, m.device)
                m.status = ParamStatus.NOT_AVAILABLE


def _check_full(group: list[tuple[nn.Parameter, ParamMeta]]) -> None:
    for p, m in group:
        if p.data.shape != m.shape:
            raise RuntimeError(f"parts.partition: {m.describe()} holds a tensor of shape "
                               f"{tuple(p.data.shape)} where its full shape {tuple(m.shape)} was "
                               f"expected; was it replaced with another shape?")
        if p.data.dtype != m.dtype:
            p.data = p.data.to(m.dtype)
