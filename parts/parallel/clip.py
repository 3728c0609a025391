"""Global gradient norm and clipping over a dp x tp grid, counting every element once.

A tensor-parallel piece (see :func:`parts.parallel.tp_split`) is a different slice on every
tp rank: all of them count. A parameter replicated over the tp group has the same grad on
every tp rank: only tp rank 0 counts it. Grads are either disjoint shards across the dp
group (ZeRO: the default) or, with ``dp_replicated=True``, the same on every dp rank (then
only dp rank 0 counts them). One all-reduce over the grid's parent group adds it all up.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from parts.comm import group_info
from parts.comm.norm import clip_coef, counts, global_norm, scale_

from .grid import ParallelGrid

GradFn = Callable[[torch.Tensor], Optional[torch.Tensor]]


def _grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    return p.grad


def grad_norm_2d(params: Iterable[torch.Tensor], grid: "ParallelGrid", *, grad_fn: GradFn = _grad,
                 norm_type: float = 2.0, dp_replicated: bool = False) -> torch.Tensor:
    """The norm of all grads over the whole grid (a collective over ``grid.group``).

    ``grad_fn(p)`` gives the grad this rank holds for ``p`` (``p.grad`` by default; a ZeRO-3
    grad shard with ``lambda p: parts.partition.meta(p).grad_shard``).
    """
    if norm_type <= 0:
        raise ValueError(f"grad_norm_2d: norm_type must be > 0, got {norm_type}")
    counted = [grad_fn(p) for p in params if counts(p, grid.tp_rank, grid.dp_rank, dp_replicated)]
    return global_norm(counted, group_info(grid.group, "grad_norm_2d"), norm_type)


def clip_grad_norm_2d(params: Iterable[torch.Tensor], max_norm: float, grid: "ParallelGrid", *,
                      grad_fn: GradFn = _grad, norm_type: float = 2.0,
                      dp_replicated: bool = False) -> torch.Tensor:
    """Scale every grad in place so the grid-wide norm is at most ``max_norm``; return the norm.

    The same coefficient as ``torch.nn.utils.clip_grad_norm_``: ``min(1, max_norm / (norm + 1e-6))``.
    A non-finite norm leaves the grads alone (the optimizer's overflow check then skips the step).
    """
    params = list(params)
    norm = grad_norm_2d(params, grid, grad_fn=grad_fn, norm_type=norm_type,
                        dp_replicated=dp_replicated)
    scale_([grad_fn(p) for p in params], clip_coef(max_norm, norm.item(), norm.dtype))
    return norm
