"""The global norm of gradients spread over ranks, and clipping by it (one all-reduce).

Every part that clips (``parts.parallel.clip_grad_norm_2d`` over a dp x tp grid,
``parts.partition.clip_grad_norm_`` over ZeRO grad shards) decides which grads this rank
*counts* (each element once over the group) and hands them here: ``sum |g|^p`` (or max
``|g|`` for inf) locally, one all-reduce, then the same coefficient as
``torch.nn.utils.clip_grad_norm_``: ``min(1, max_norm / (norm + 1e-6))``.

``counts(p, tp_rank, dp_rank, dp_replicated)``: the rule of a grid. A tensor-parallel piece
(a parameter with a ``tp_dim`` attribute, see ``parts.parallel.tp_split``) is a different
slice on every tp rank: all count; a parameter replicated over tp counts on tp rank 0 only.
A grad replicated over dp (not sharded) counts on dp rank 0 only.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterable

import torch

from parts.comm.collectives import ReduceOp, all_reduce
from parts.comm.group import GroupInfo


def counts(p: torch.Tensor, tp_rank: int, dp_rank: int, dp_replicated: bool) -> bool:
    """True if this rank counts ``p``'s grad in a grid-wide norm (each element once)."""
    if dp_replicated and dp_rank != 0:
        return False
    return getattr(p, "tp_dim", None) is not None or tp_rank == 0


def _plain(g: torch.Tensor) -> torch.Tensor:
    """A plain-tensor view (grad shards refuse a norm that is not global: this one is)."""
    return g.as_subclass(torch.Tensor) if type(g) is not torch.Tensor else g


def global_norm(grads: Iterable[torch.Tensor], info: GroupInfo, norm_type: float = 2.0,
                norms: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """The ``norm_type`` norm over the counted ``grads`` of every rank of ``info`` (fp32, or
    float64 where a grad is float64; CPU); ``norms``: the ``norm_type`` norms of counted grads
    that are gone (stepped already)."""
    if norm_type <= 0:
        raise ValueError(f"global_norm: norm_type must be > 0, got {norm_type}")
    grads = [g for g in grads if g is not None and g.numel() > 0]
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    local = torch.zeros((), dtype=dtype)
    computed = (torch.linalg.vector_norm(_plain(g).to(dtype), norm_type) for g in grads)
    for n in itertools.chain(computed, norms):
        n = n.cpu()
        local = torch.maximum(local, n) if math.isinf(norm_type) else local + n.pow(norm_type)
    if math.isinf(norm_type):
        return all_reduce(local, info, ReduceOp.MAX)
    return all_reduce(local, info).pow(1.0 / norm_type)


def scale_(grads: Iterable[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale ``grads`` in place so that ``norm`` becomes at most ``max_norm``; a non-finite norm
    leaves them alone (the optimizer's overflow check then skips the step)."""
    coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    if not math.isfinite(float(norm)) or coef >= 1.0:
        return
    for g in grads:
        if g is not None:
            g.mul_(coef)
