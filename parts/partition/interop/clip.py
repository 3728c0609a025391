"""Gradient norm and clipping of a sharded model: the global norm over every rank's grad shards.

Each rank holds a disjoint shard of every sharded parameter's gradient (its grad shard), so
all of them count; a parameter that is not sharded has the same (averaged) grad on every
rank and counts on rank 0 only. With a ``grid`` (``parts.parallel.ParallelGrid``) the
shards are over its dp group and tensor-parallel pieces count on every tp rank, parameters
replicated over tp on tp rank 0 only (the rule of ``parts.parallel.clip_grad_norm_2d``, in
``parts.comm.norm``); the all-reduce is over ``grid.group``.

In reproducible mode (parameters of a model attached with ``reproducible=True``) the 2-norm is
summed in fixed point (``parts.comm.exact_norm``): the same bits at every world size, over a
``grid`` too; grads consumed by ``OffloadedOptimizer.step_in_backward`` (their norms kept in
float) are refused there.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from parts.comm import GroupInfo, group_info
from parts.comm.exact_norm import exact_global_norm
from parts.comm.norm import clip_coef, counts, global_norm, scale_
from parts.partition.core import disk
from parts.partition.core.grad_guard import internal, raw_grad
from parts.partition.core.param import is_partitioned, meta, unique_params
from parts.partition.core.replicas import pending_records, sync_replica_grads

Params = Union[nn.Module, Iterable[torch.Tensor]]


def _params(model_or_params: Params) -> list[torch.Tensor]:
    if isinstance(model_or_params, nn.Module):
        return unique_params(model_or_params.parameters())
    return unique_params(model_or_params)


def _check_reduced(p: torch.Tensor) -> None:
    with internal:
        full = raw_grad(p)
    if full is not None:
        raise RuntimeError(f"clip_grad_norm_: {meta(p).describe()} still has a full gradient in "
                           "p.grad (not reduce-scattered yet): call it after backward() of an "
                           "attached model, or after reduce_scatter_grads")


def _grad_of(p: torch.Tensor) -> Optional[torch.Tensor]:
    """The grad this rank holds for ``p``: its grad shard if sharded (read from the store if it
    is there), else ``p.grad``."""
    if not is_partitioned(p):
        return p.grad
    _check_reduced(p)
    shard = meta(p).shard
    if disk.has_grad(shard):
        return disk.read_grad(shard)
    return meta(p).grad_shard


def _grad_source(p: torch.Tensor) -> Any:
    """``_grad_of(p)``, but a grad in the store as a callable that reads it when the norm gets to
    it (one stored grad in memory at a time)."""
    if is_partitioned(p) and disk.has_grad(meta(p).shard):
        _check_reduced(p)
        return functools.partial(disk.read_grad, meta(p).shard)
    return _grad_of(p)


def _consumed(p: torch.Tensor, norm_type: float) -> Optional[torch.Tensor]:
    """The norm of ``p``'s grad shard if a step during backward consumed it, else None."""
    return disk.consumed_norm(meta(p).shard, norm_type) if is_partitioned(p) else None


def _info(params: list, grid: Any) -> GroupInfo:
    if grid is not None:
        return group_info(grid.group, "clip_grad_norm_")
    groups = {id(meta(p).group): meta(p).info for p in params if is_partitioned(p)}
    if len(groups) > 1:
        raise ValueError("clip_grad_norm_: parameters sharded over different process groups; "
                         "pass grid= (a parts.parallel.ParallelGrid) or clip each group's parameters")
    return next(iter(groups.values())) if groups else group_info(None, "clip_grad_norm_")


def _counted(params: list, info: GroupInfo, grid: Any) -> list:
    tp_rank = grid.tp_rank if grid is not None else 0
    dp_rank = grid.dp_rank if grid is not None else info.rank
    return [p for p in params if counts(p, tp_rank, dp_rank, dp_replicated=not is_partitioned(p))]


def grad_norm(model_or_params: Params, norm_type: float = 2.0, *, grid: Any = None) -> torch.Tensor:
    """The norm of the whole gradient of a sharded model (a collective over its group): grad
    shards in memory, in a ``DiskStore`` (read one at a time) or consumed by a step during
    backward (``OffloadedOptimizer.step_in_backward``: their norms were kept)."""
    params = _params(model_or_params)
    sync_replica_grads(pending_records(params))  # a hybrid layout's grads: the mean over replicas
    info = _info(params, grid)  # the shard group: each element counts once, never per replica
    counted = _counted(params, info, grid)
    consumed = {id(p): _consumed(p, norm_type) for p in counted}
    kept = [n for n in consumed.values() if n is not None]
    grads = [_grad_source(p) for p in counted if consumed[id(p)] is None]
    if float(norm_type) == 2.0 and _exact(params):
        _refuse_kept(counted, consumed)
        wide = any(is_partitioned(p) and meta(p).exact.dtype == torch.float64 for p in params)
        bound = _count(params) * (grid.tp_size if grid is not None else 1)  # every tp rank's pieces
        return exact_global_norm(grads, info, bound, torch.float64 if wide else torch.float32)
    return global_norm(grads, info, float(norm_type), norms=kept)


def _refuse_kept(counted: list, consumed: dict) -> None:
    """Raise if a grad of a model in reproducible mode was consumed by a step during backward: its
    kept norm is a float sum, not the fixed-point one."""
    stepped = [p for p in counted if consumed[id(p)] is not None]
    if stepped:
        raise RuntimeError(f"clip_grad_norm_ / grad_norm: reproducible mode takes the grad norm in fixed "
                           f"point, but the grads of {len(stepped)} parameters (the first: "
                           f"{meta(stepped[0]).describe()}) were consumed by a step inside "
                           f"OffloadedOptimizer.step_in_backward(), which keeps float norms only; call "
                           f"backward outside step_in_backward() to take the norm or clip")


def _exact(params: list) -> bool:
    """True if ``params`` belong to a model in reproducible mode."""
    return any(is_partitioned(p) and meta(p).exact is not None for p in params)


def _count(params: list) -> int:
    """Elements of ``params`` at full size: the same at any world size."""
    return sum(meta(p).numel if is_partitioned(p) else p.numel() for p in params)


def clip_grad_norm_(model_or_params: Params, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False, grid: Any = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a sharded model: scale every grad shard (in memory
    or in a ``DiskStore``) by the same ``min(1, max_norm / (norm + 1e-6))`` of the global norm;
    return that norm (every rank). Grads a step during backward consumed cannot be scaled: a
    clip that would scale them raises."""
    params = _params(model_or_params)
    norm = grad_norm(params, norm_type, grid=grid)
    value = norm.item()  # the one host sync of a clip
    if error_if_nonfinite and not math.isfinite(value):
        raise RuntimeError(f"clip_grad_norm_: the global gradient norm of order {norm_type} is "
                           f"{value}; pass error_if_nonfinite=False to leave the grads unscaled")
    coef = clip_coef(max_norm, value, norm.dtype)
    if coef >= 1.0:
        return norm
    _refuse_consumed(params, value, max_norm)
    stored = [p for p in params if is_partitioned(p) and disk.has_grad(meta(p).shard)]
    for p in stored:  # read, scale and write back one at a time
        disk.scale_grad(meta(p).shard, coef)
    held = {id(p) for p in stored}
    scale_([_grad_of(p) for p in params if id(p) not in held], coef)
    return norm


def _refuse_consumed(params: list, norm: float, max_norm: float) -> None:
    """Raise if a grad that would be scaled was already stepped during backward."""
    stepped = [p for p in params if _consumed(p, 2.0) is not None]
    if stepped:
        raise RuntimeError(f"clip_grad_norm_: the global grad norm {norm:.4g} exceeds max_norm="
                           f"{max_norm}, but the grads of {len(stepped)} parameters (the first: "
                           f"{meta(stepped[0]).describe()}) were already stepped during backward "
                           f"inside OffloadedOptimizer.step_in_backward(); a clip needs every grad "
                           f"before any step: call backward outside step_in_backward() to clip")
