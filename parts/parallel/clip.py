"""Global gradient norm and clipping over a dp x tp grid, counting every element once.

A tensor-parallel piece (see :func:`parts.parallel.tp_split`) is a different slice on every
tp rank: all of them count. A parameter replicated over the tp group has the same grad on
every tp rank: only tp rank 0 counts it. Grads are either disjoint shards across the dp
group (ZeRO: the default) or, with ``dp_replicated=True``, the same on every dp rank (then
only dp rank 0 counts them). One all-reduce over the grid's parent group adds it all up.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

import torch

from . import _collectives as C
from .grid import ParallelGrid
from .layers import tp_split

__all__ = ["grad_norm_2d", "clip_grad_norm_2d"]

GradFn = Callable[[torch.Tensor], Optional[torch.Tensor]]


def _grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    return p.grad


def _local_sum(params: list, grad_fn: GradFn, tp_rank: int, counts_dp: bool,
               norm_type: float) -> torch.Tensor:
    """``sum |g|^p`` (or max |g| for inf) of the grads this rank counts."""
    total = torch.zeros((), dtype=torch.float32)
    for p in params:
        g = grad_fn(p)
        if g is None or g.numel() == 0 or not counts_dp:
            continue
        if tp_split(p) is None and tp_rank != 0:
            continue
        n = torch.linalg.vector_norm(g.float(), norm_type).cpu()
        total = torch.maximum(total, n) if math.isinf(norm_type) else total + n.pow(norm_type)
    return total


def grad_norm_2d(params: Iterable[torch.Tensor], grid: ParallelGrid, *, grad_fn: GradFn = _grad,
                 norm_type: float = 2.0, dp_replicated: bool = False) -> torch.Tensor:
    """The norm of all grads over the whole grid (a collective over ``grid.group``).

    ``grad_fn(p)`` gives the grad this rank holds for ``p`` (``p.grad`` by default; a ZeRO-3
    grad shard with ``lambda p: parts.partition.meta(p).grad_shard``).
    """
    if norm_type <= 0:
        raise ValueError(f"grad_norm_2d: norm_type must be > 0, got {norm_type}")
    counts_dp = grid.dp_rank == 0 or not dp_replicated
    local = _local_sum(list(params), grad_fn, grid.tp_rank, counts_dp, norm_type)
    if math.isinf(norm_type):
        return C.all_reduce_max(local, grid.group)
    return C.all_reduce_sum(local, grid.group).pow(1.0 / norm_type)


def clip_grad_norm_2d(params: Iterable[torch.Tensor], max_norm: float, grid: ParallelGrid, *,
                      grad_fn: GradFn = _grad, norm_type: float = 2.0,
                      dp_replicated: bool = False) -> torch.Tensor:
    """Scale every grad in place so the grid-wide norm is at most ``max_norm``; return the norm.

    The same coefficient as ``torch.nn.utils.clip_grad_norm_``: ``min(1, max_norm / (norm + 1e-6))``.
    A non-finite norm leaves the grads alone (the optimizer's overflow check then skips the step).
    """
    params = list(params)
    norm = grad_norm_2d(params, grid, grad_fn=grad_fn, norm_type=norm_type,
                        dp_replicated=dp_replicated)
    coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    if math.isfinite(float(norm)) and coef < 1.0:
        for p in params:
            g = grad_fn(p)
            if g is not None:
                g.mul_(coef)
    return norm
