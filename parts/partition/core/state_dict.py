"""Consolidated (full) state dicts in and out of a sharded model.

``full_state_dict`` has exactly the keys, order and shapes of the plain module's
``state_dict()`` (tied weights appear under every key, as in torch); no tensor of it is
shared with the module (editing it leaves the model as it was). Parameters are
gathered in buckets of ``bucket_numel`` elements and released again, so the peak is the
output plus one bucket (one parameter per bucket when shards are on disk: ``_limit``, so a
model that does not fit in memory never has more than one parameter's full tensor and
shard read in beyond the result); parameters already gathered are read as they are, unless their
shard changed since they were gathered (then they are fetched again). ``load_full_state_dict``
loads **rank 0's** dict on every rank:
rank 0 checks keys and shapes (the verdict is broadcast so all ranks raise together),
then broadcasts each bucket and every rank keeps its slice; other ranks may pass ``{}``.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional

import torch
from torch import nn

from parts._compat import incompatible_keys
from parts.comm import GroupInfo, broadcast, broadcast_object, resolve_group
from parts.partition.core import disk, points
from parts.partition.core.gather import gather, release
from parts.partition.core.param import ParamStatus, alloc, internal, is_partitioned, meta, metas_sorted, stamp
from parts.partition.core.sharding import write_shard

_BUCKET = 50_000_000


def _buckets(pairs: list, limit: int) -> Iterator[list]:
    """Consecutive runs of ``pairs`` with at most ``limit`` elements (at least one pair each)."""
    run, size = [], 0
    for pm in pairs:
        if run and size + pm[1].numel > limit:
            yield run
            run, size = [], 0
        run.append(pm)
        size += pm[1].numel
    if run:
        yield run


def _limit(pairs: list, bucket_numel: int) -> int:
    """``bucket_numel``, or 1 (one parameter per bucket) if some shard lives in a ``DiskStore``."""
    return 1 if any(disk.parked_version(m.shard) is not None for _, m in pairs) else bucket_numel


def _check_module(module: Any, what: str) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{what}: expected an nn.Module, got {type(module).__name__}")


def _partitioned_pairs(sd: Mapping[str, Any]) -> list:
    return metas_sorted(v for v in sd.values() if is_partitioned(v))


def _info(pairs: list) -> GroupInfo:
    return pairs[0][1].info if pairs else resolve_group(None, "parts.partition")


@internal
def full_state_dict(module: nn.Module, rank0_only: bool = True, bucket_numel: int = _BUCKET) -> dict[str, Any]:
    """The plain ``state_dict()`` of a sharded module (on rank 0 only, ``{}`` elsewhere, if ``rank0_only``)."""
    _check_module(module, "full_state_dict")
    own = module.state_dict(keep_vars=True)
    pairs = _partitioned_pairs(own)
    points.announce([p for p, _ in pairs], "full_state_dict")
    keep = not rank0_only or _info(pairs).rank == 0
    full: dict[int, torch.Tensor] = {}
    for bucket in _buckets(pairs, _limit(pairs, bucket_numel)):
        ours = [p for p, m in bucket if m.status is not ParamStatus.AVAILABLE]
        gather([p for p, _ in bucket])
        if keep:  # a parameter kept gathered (persistent) stays live: copy it
            full.update({id(p): p.detach() if any(p is q for q in ours) else p.detach().clone() for p, _ in bucket})
        release(ours)
    if not keep:
        return {}
    return {k: (full[id(v)] if is_partitioned(v) else v.detach().clone() if isinstance(v, torch.Tensor) else v)
            for k, v in own.items()}


def _shape_of(v: torch.Tensor) -> torch.Size:
    return meta(v).shape if is_partitioned(v) else v.shape


def _kind(dtype: torch.dtype) -> str:
    return "complex" if dtype.is_complex else "floating point" if dtype.is_floating_point else "integer/bool"


def _value_error(k: str, value: Any, target: torch.Tensor) -> Optional[str]:
    """Why ``value`` cannot be loaded into the module entry ``target`` (key ``k``), or None."""
    if not isinstance(value, torch.Tensor):
        return f"'{k}' is a {type(value).__name__}, expected a tensor"
    if tuple(value.shape) != tuple(_shape_of(target)):
        return f"size mismatch for '{k}': checkpoint {tuple(value.shape)}, model {tuple(_shape_of(target))}"
    dtype = meta(target).dtype if is_partitioned(target) else target.dtype
    if _kind(value.dtype) != _kind(dtype):
        return f"dtype mismatch for '{k}': checkpoint {value.dtype}, model {dtype}"
    return None


def _verdict(own: Mapping[str, Any], sd: Mapping[str, Any], strict: bool) -> Optional[str]:
    """The error message for ``sd`` against the module's keys, shapes and dtype kinds, or None."""
    tensors = [k for k, v in own.items() if isinstance(v, torch.Tensor)]
    missing = [k for k in tensors if k not in sd]
    unexpected = [k for k in sd if k not in own]
    errors = [e for e in (_value_error(k, sd[k], own[k]) for k in tensors if k in sd) if e]
    if strict and missing:
        errors.append(f"missing keys: {missing}")
    if strict and unexpected:
        errors.append(f"unexpected keys: {unexpected}")
    return "load_full_state_dict: " + "; ".join(errors) if errors else None


@internal
def load_full_state_dict(module: nn.Module, sd: Optional[Mapping[str, Any]], strict: bool = True,
                         bucket_numel: int = _BUCKET) -> Any:
    """Load rank 0's full ``sd`` into a (sharded) module; returns rank 0's missing/unexpected
    keys on every rank (what was loaded everywhere)."""
    _check_module(module, "load_full_state_dict")
    if sd is not None and not isinstance(sd, Mapping):
        raise TypeError(f"load_full_state_dict: sd must be a mapping of key -> tensor, got {type(sd).__name__}")
    own = module.state_dict(keep_vars=True)
    points.announce([p for p, _ in _partitioned_pairs(own)], "load_full_state_dict")
    info = _info(_partitioned_pairs(own))
    sd = sd if sd is not None else {}
    verdict = _verdict(own, sd, strict) if info.rank == 0 else None
    # rank 0's keys decide, on every rank: other ranks may pass {} (their own keys mean nothing)
    missing = [k for k in own if isinstance(own[k], torch.Tensor) and k not in sd]
    unexpected = [k for k in sd if k not in own]
    verdict, present, missing, unexpected = broadcast_object(
        (verdict, [k for k in own if k in sd], missing, unexpected), 0, info.group)
    replica = _replica(_partitioned_pairs(own))
    if replica is not None:  # a hybrid layout: the first replica's rank 0 (global rank 0) decides
        verdict, present, missing, unexpected = broadcast_object(
            (verdict, present, missing, unexpected), 0, replica.group)
    if verdict:
        raise RuntimeError(verdict)
    keys = {}
    for k in present:
        keys.setdefault(id(own[k]), k)
    pairs = [(p, m) for p, m in _partitioned_pairs(own) if id(p) in keys]
    for bucket in _buckets(pairs, _limit(pairs, bucket_numel)):
        _load_bucket(bucket, [sd.get(keys[id(p)]) for p, _ in bucket], info, replica)
    for k in present:
        v = own[k]
        if isinstance(v, torch.Tensor) and not is_partitioned(v) and keys.get(id(v)) == k:
            with torch.no_grad():
                if _first(info, replica):
                    v.copy_(sd[k])
                _broadcast(v.data, info, replica)
    return incompatible_keys(missing, unexpected)


def _replica(pairs: list) -> Optional[GroupInfo]:
    """The replica group of a hybrid layout's records (None: no replicas)."""
    return pairs[0][1].replica if pairs else None


def _first(info: GroupInfo, replica: Optional[GroupInfo]) -> bool:
    """True on the rank whose values load: rank 0 of the group (of the first replica's group)."""
    return info.rank == 0 and (replica is None or replica.rank == 0)


def _broadcast(t: torch.Tensor, info: GroupInfo, replica: Optional[GroupInfo]) -> None:
    """``t`` from the loading rank to every rank: across replicas (rank 0 of each group), then within."""
    if replica is not None and info.rank == 0:
        broadcast(t, 0, replica)
    broadcast(t, 0, info)


def _load_bucket(bucket: list, values: list, info: GroupInfo, replica: Optional[GroupInfo] = None) -> None:
    """Broadcast rank 0's ``values`` for the params of ``bucket`` (by dtype) and rewrite shards."""
    for dtype in sorted({m.dtype for _, m in bucket}, key=str):
        group = [(p, m, v) for (p, m), v in zip(bucket, values) if m.dtype == dtype]
        flat = alloc(sum(m.numel for _, m, _ in group), dtype, group[0][1].device)
        off = 0
        for _, m, v in group:
            if _first(info, replica):
                flat[off:off + m.numel].copy_(v.detach().reshape(-1))
            off += m.numel
        _broadcast(flat, info, replica)
        off = 0
        for p, m, _ in group:
            piece = flat[off:off + m.numel]
            write_shard(m.shard, piece, m.layout, m.rank)
            if m.status is ParamStatus.AVAILABLE:
                p.data.copy_(piece.view(m.shape))
                stamp(m)  # full tensor and shard agree again
            off += m.numel
