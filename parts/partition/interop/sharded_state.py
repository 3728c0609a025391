"""Sharded model state dicts for ``torch.distributed.checkpoint`` (DCP), at any world size.

``sharded_state_dict(model)`` has the keys of ``model.state_dict()``; a sharded parameter's
value is a ``parts.comm.dcp.ShardView``: the global shape, and this rank's real (unpadded)
shard elements as row-aligned boxes that are views of the shard itself (a shard on disk,
``partitioned(remote_device=DiskStore(...))``, is a deferred segment: DCP reads it from the
store when it writes it and writes it there when it loads it, one shard at a time: see
``parts.offload.lease``). Buffers and
unsharded parameters are the module's own tensors (DCP writes a replicated value once).
``dcp.save`` (or ``parts.comm.dcp.save`` where numpy is absent) writes one file per rank;
``dcp.load`` of the same dict at any world size, FSDP2's included, copies every saved piece
straight into the shards it overlaps, and ``load_sharded_state_dict`` makes the model use
what was loaded (full tensors of gathered parameters are fetched again). The keys and
the global shapes are those of FSDP2's ``get_model_state_dict``: checkpoints go both ways.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import nn

from parts._compat import incompatible_keys
from parts.partition.core import disk, points
from parts.partition.core.gather import gather
from parts.partition.core.param import (ParamMeta, ParamStatus, internal, is_partitioned, is_stale, meta, metas_sorted,
                                        stamp)


def _dcp():
    """``parts.comm.dcp``, imported on first use (torch.distributed.checkpoint takes seconds to import)."""
    from parts.comm import dcp
    return dcp


def real_shard(m: ParamMeta, tensor: Any) -> tuple[int, Any]:
    """``(flat start, the real elements of the shard-sized 1-D tensor)`` this rank holds of ``m``
    (a ``Stored`` shard on disk gives a ``Stored`` range)."""
    start, stop = m.layout.range(m.rank)
    return start, tensor.reshape(-1).narrow(0, 0, stop - start)


def shard_view(m: ParamMeta, tensor: Any, name: str) -> Any:
    """A ShardView of the global shape of ``m`` over this rank's part of ``tensor`` (shard-sized:
    a tensor, or a ``Stored`` one in a DiskStore)."""
    if tensor.numel() != m.layout.shard_numel:
        raise ValueError(f"{name}: expected {m.layout.shard_numel} elements (the shard of {m.describe()}) "
                         f"on rank {m.rank}, got {tensor.numel()}")
    return _dcp().ShardView(m.shape, [real_shard(m, tensor)], dtype=tensor.dtype, device=tensor.device,
                            name=name, holder=tensor)


def _check_module(module: Any, what: str) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{what}: expected an nn.Module, got {type(module).__name__}")


def own_shard(m: ParamMeta) -> Any:
    """``m``'s shard: the tensor, or (a shard on disk) its ``Stored`` bytes."""
    stored = disk.stored(m.shard)
    return m.shard if stored is None else stored


def adopt_edit(key: str, p: nn.Parameter) -> None:
    """Write into ``p``'s shard this rank's part of an in-place edit of its gathered (current)
    full tensor, such as peft's ``merge_and_unload`` on weights an attached model keeps gathered:
    every rank made the same edit, so the shards hold it. An edit of a copy in another dtype than
    the shard (mixed precision) raises: it would lose the shard's precision."""
    m = meta(p)
    if (m.status is not ParamStatus.AVAILABLE or is_stale(m) or m.compression is not None
            or disk.stored(m.shard) is not None or p.data.numel() != m.numel or p.data.is_meta):
        return
    start, mine = real_shard(m, m.shard)
    seen = p.data.reshape(-1).narrow(0, start, mine.numel())
    if torch.equal(seen, mine.to(seen.dtype)):
        return
    if seen.dtype != mine.dtype:
        raise RuntimeError(
            f"parts.partition: the gathered {seen.dtype} copy of '{key}' ({m.describe()}) was edited in place "
            f"(e.g. peft's merge_and_unload) but its shards are {mine.dtype}: the edit would not reach them. "
            f"Edit weights inside `with parts.partition.gathered(params, modifier_rank=0):`, or call "
            f"parts.partition.refresh(model) to drop the edit")
    with torch.no_grad():
        mine.copy_(seen)
    stamp(m)


def adopt_edits(named: Iterable[tuple[str, nn.Parameter]]) -> None:
    """``adopt_edit`` for every ``(name, parameter)``: before kept-gathered copies are released (detach)."""
    for key, p in named:
        adopt_edit(key, p)


@internal
def sharded_state_dict(model: nn.Module) -> dict[str, Any]:
    """Every entry of ``model.state_dict()``, sharded parameters as DCP views of this rank's shard."""
    _check_module(model, "sharded_state_dict")
    out: dict[str, Any] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if is_partitioned(value):
            adopt_edit(key, value)
            out[key] = shard_view(meta(value), own_shard(meta(value)), key)
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach()
        else:
            out[key] = value
    return out


def _install_param(key: str, p: nn.Parameter, value: Any) -> None:
    """Make ``p``'s shard hold ``value`` (a ShardView DCP filled, or a full tensor)."""
    m = meta(p)
    start, mine = real_shard(m, own_shard(m))
    dcp = _dcp()
    if isinstance(value, dcp.ShardView):
        if tuple(value.shape) != tuple(m.shape):
            raise ValueError(f"load_sharded_state_dict: '{key}' is a view of shape {tuple(value.shape)}, "
                             f"the model's {m.describe()}")
        foreign = [(s, seg) for s, seg in value.segments if s != start or not dcp.same_piece(seg, mine)]
        if foreign:  # pieces of other memory (not what DCP filled in place): copied in
            with torch.no_grad(), disk.rewrite(m.shard):
                for s, seg in foreign:
                    _copy_overlap(real_shard(m, m.shard)[1], start, _data(seg), s)
        return
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(m.shape):
        raise ValueError(f"load_sharded_state_dict: '{key}' should be a ShardView from sharded_state_dict "
                         f"or a tensor of shape {tuple(m.shape)}, got {type(value).__name__} "
                         f"{tuple(getattr(value, 'shape', ()))}")
    with torch.no_grad(), disk.rewrite(m.shard):
        mine = real_shard(m, m.shard)[1]
        mine.copy_(value.detach().reshape(-1).narrow(0, start, mine.numel()))


def _data(piece: Any) -> torch.Tensor:
    return piece.materialize() if _dcp().is_deferred(piece) else piece


def _copy_overlap(dst: torch.Tensor, dst_start: int, src: torch.Tensor, src_start: int) -> None:
    """Copy the flat overlap of ``src`` (at ``src_start``) into ``dst`` (at ``dst_start``)."""
    lo, hi = max(dst_start, src_start), min(dst_start + dst.numel(), src_start + src.numel())
    if hi > lo:
        dst.narrow(0, lo - dst_start, hi - lo).copy_(src.narrow(0, lo - src_start, hi - lo))


def _install_tensor(key: str, target: torch.Tensor, value: Any) -> None:
    if not isinstance(value, torch.Tensor) or value.shape != target.shape:
        raise ValueError(f"load_sharded_state_dict: '{key}' should be a tensor of shape {tuple(target.shape)}, "
                         f"got {type(value).__name__} {tuple(getattr(value, 'shape', ()))}")
    if not _dcp().same_piece(value, target):
        with torch.no_grad():
            target.copy_(value)


@internal
def load_sharded_state_dict(model: nn.Module, state: Mapping[str, Any], strict: bool = True) -> Any:
    """Install what ``dcp.load`` filled into ``sharded_state_dict(model)`` (or full tensors per key);
    returns the missing/unexpected keys, raises on them when ``strict``."""
    _check_module(model, "load_sharded_state_dict")
    if not isinstance(state, Mapping):
        raise TypeError(f"load_sharded_state_dict: state must be a mapping, got {type(state).__name__}")
    own = model.state_dict(keep_vars=True)
    missing = [k for k, v in own.items() if isinstance(v, torch.Tensor) and k not in state]
    unexpected = [k for k in state if k not in own]
    if strict and (missing or unexpected):
        raise RuntimeError(f"load_sharded_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    partitioned = [v for v in own.values() if is_partitioned(v)]
    points.announce(partitioned, "load_sharded_state_dict")
    _dcp().settle(dict(state))  # what DCP wrote into shards on disk goes to their store
    for key, target in own.items():
        if key not in state or not isinstance(target, torch.Tensor):
            continue
        if is_partitioned(target):
            _install_param(key, target, state[key])
        else:
            _install_tensor(key, target.detach(), state[key])
    _refetch_stale(partitioned)
    return incompatible_keys(missing, unexpected)


def _refetch_stale(params: list) -> None:
    """Gather again the parameters that stayed gathered while their shards were loaded (all of
    them: a rank whose shard is only padding loaded nothing, yet must join the collective)."""
    stale = [(p, m) for p, m in metas_sorted(params) if m.status is ParamStatus.AVAILABLE]
    for _, m in stale:
        m.full_version = None  # the full tensor no longer matches the shard: is_stale is True
    for compute in (False, True):
        batch = [p for p, m in stale if (m.full_dtype not in (None, m.dtype)) == compute]
        if batch:
            gather(batch, compute=compute)
