"""Gradient norm and clipping of a sharded model: the global norm over every rank's grad shards.

Each rank holds a disjoint shard of every sharded parameter's gradient (its grad shard), so
all of them count; a parameter that is not sharded has the same (averaged) grad on every
rank and counts on rank 0 only. With a ``grid`` (``parts.parallel.ParallelGrid``) the
shards are over its dp group and tensor-parallel pieces count on every tp rank, parameters
replicated over tp on tp rank 0 only (the rule of ``parts.parallel.clip_grad_norm_2d``, in
``parts.comm.norm``); the all-reduce is over ``grid.group``.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from parts.comm import GroupInfo, group_info
from parts.comm.norm import counts, global_norm, scale_
from parts.partition.core.grad_guard import internal, raw_grad
from parts.partition.core.param import is_partitioned, meta, unique_params

Params = Union[nn.Module, Iterable[torch.Tensor]]


def _params(model_or_params: Params) -> list[torch.Tensor]:
    if isinstance(model_or_params, nn.Module):
        return unique_params(model_or_params.parameters())
    return unique_params(model_or_params)


def _grad_of(p: torch.Tensor) -> Optional[torch.Tensor]:
    """The grad this rank holds for ``p``: its grad shard if sharded, else ``p.grad``."""
    if is_partitioned(p):
        with internal:
            full = raw_grad(p)
        if full is not None:
            raise RuntimeError(f"clip_grad_norm_: {meta(p).describe()} still has a full gradient in "
                               "p.grad (not reduce-scattered yet): call it after backward() of an "
                               "attached model, or after reduce_scatter_grads")
        return meta(p).grad_shard
    return p.grad


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
    return [_grad_of(p) for p in params
            if counts(p, tp_rank, dp_rank, dp_replicated=not is_partitioned(p))]


def grad_norm(model_or_params: Params, norm_type: float = 2.0, *, grid: Any = None) -> torch.Tensor:
    """The norm of the whole gradient of a sharded model (a collective over its group)."""
    params = _params(model_or_params)
    info = _info(params, grid)
    return global_norm(_counted(params, info, grid), info, float(norm_type))


def clip_grad_norm_(model_or_params: Params, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False, grid: Any = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a sharded model: scale every grad shard by the same
    ``min(1, max_norm / (norm + 1e-6))`` of the global norm; return that norm (every rank)."""
    params = _params(model_or_params)
    norm = grad_norm(params, norm_type, grid=grid)
    if error_if_nonfinite and not math.isfinite(float(norm)):
        raise RuntimeError(f"clip_grad_norm_: the global gradient norm of order {norm_type} is "
                           f"{float(norm)}; pass error_if_nonfinite=False to leave the grads unscaled")
    scale_([_grad_of(p) for p in params], max_norm, norm)
    return norm
