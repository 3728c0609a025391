"""The global norm of gradients spread over ranks, and clipping by it (one all-reduce).

Every part that clips (``parts.parallel.clip_grad_norm_2d`` over a dp x tp grid,
``parts.partition.clip_grad_norm_`` over ZeRO grad shards) decides which grads this rank
*counts* (each element once over the group) and hands them here: ``sum |g|^p`` (or max
``|g|`` for inf) locally, one all-reduce, then the same coefficient as
``torch.nn.utils.clip_grad_norm_``: ``min(1, max_norm / (norm + 1e-6))``. The norms are taken
on the grads' device (one ``_foreach_norm`` per device), added on the group's communication
device and all-reduced there; a clip reads the result to the host once.

``counts(p, tp_rank, dp_rank, dp_replicated)``: the rule of a grid. A tensor-parallel piece
(a parameter with a ``tp_dim`` attribute, see ``parts.parallel.tp_split``) is a different
slice on every tp rank: all count; a parameter replicated over tp counts on tp rank 0 only.
A grad replicated over dp (not sharded) counts on dp rank 0 only.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Iterable, Optional, Union

import torch

from parts._compat import foreach_norm
from parts.comm.collectives import ReduceOp, all_reduce
from parts.comm.device import comm_device
from parts.comm.group import GroupInfo


def counts(p: torch.Tensor, tp_rank: int, dp_rank: int, dp_replicated: bool) -> bool:
    """True if this rank counts ``p``'s grad in a grid-wide norm (each element once)."""
    if dp_replicated and dp_rank != 0:
        return False
    return getattr(p, "tp_dim", None) is not None or tp_rank == 0


def _plain(g: torch.Tensor) -> torch.Tensor:
    """A plain-tensor view (grad shards refuse a norm that is not global: this one is)."""
    return g.as_subclass(torch.Tensor) if type(g) is not torch.Tensor else g


Grad = Union[torch.Tensor, Callable[[], torch.Tensor]]
"""A grad, or a callable reading it when its turn comes (a grad held in a store: one at a time)."""


def local_norms(grads: Iterable[Optional[Grad]], norm_type: float,
                dtype: Optional[torch.dtype] = torch.float32) -> list[torch.Tensor]:
    """The ``norm_type`` norm (in ``dtype``; None: each grad's own) of each non-empty grad, in
    order: the grads in memory in one ``_foreach_norm`` per device and dtype, the callables read
    and measured one at a time."""
    items = [g for g in grads if g is not None and (callable(g) or g.numel() > 0)]
    held = [_plain(g) for g in items if not callable(g)]
    kinds: dict[tuple, list[int]] = {}
    for i, g in enumerate(held):
        kinds.setdefault((g.device, g.dtype), []).append(i)
    norms: list[Optional[torch.Tensor]] = [None] * len(held)
    for (_, kind), idx in kinds.items():
        for i, n in zip(idx, foreach_norm([held[i] for i in idx], norm_type, dtype or kind)):
            norms[i] = n
    found, out = iter(norms), []
    for g in items:
        if not callable(g):
            out.append(next(found))
            continue
        read = _plain(g())
        if read.numel():
            out.append(torch.linalg.vector_norm(read, norm_type, dtype=dtype or read.dtype))
    return out


def local_sum(norms: Iterable[torch.Tensor], device: torch.device, norm_type: float,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``sum n^p`` (max for inf, count for 0) of ``norms`` as a ``dtype`` scalar on ``device``, added in
    order: on the norms' own device where they share one (one copy to ``device`` at the end: no
    host sync per norm when gloo carries CUDA grads), else on ``device``."""
    norms = list(norms)
    devices = {n.device for n in norms}
    where = devices.pop() if len(devices) == 1 else device
    local = torch.zeros((), dtype=dtype, device=where)
    for n in norms:
        n = n.to(where, dtype)
        if math.isinf(norm_type):
            local = torch.maximum(local, n)
        else:
            local = local + (n if norm_type == 0 else n.pow(norm_type))
    return local.to(device)


def global_norm(grads: Iterable[Optional[Grad]], info: GroupInfo, norm_type: float = 2.0,
                norms: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """The ``norm_type`` norm over the counted ``grads`` of every rank of ``info`` (fp32, or float64
    where a grad in memory is float64; on the group's communication device: reading it is the one
    host sync); ``norms``: the ``norm_type`` norms of counted grads that are gone (stepped already)."""
    if norm_type <= 0:
        raise ValueError(f"global_norm: norm_type must be > 0, got {norm_type}")
    grads = list(grads)
    wide = any(g is not None and not callable(g) and g.dtype == torch.float64 for g in grads)
    dtype = torch.float64 if wide else torch.float32
    local = local_sum(itertools.chain(local_norms(grads, norm_type, dtype), norms), comm_device(info),
                      norm_type, dtype)
    total = all_reduce(local, info, ReduceOp.MAX if math.isinf(norm_type) else ReduceOp.SUM)
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def clip_coef(max_norm: float, norm: float, dtype: torch.dtype = torch.float32) -> float:
    """``min(1, max_norm / (norm + 1e-6))`` in the norm's ``dtype`` as ``torch.nn.utils.clip_grad_norm_``
    computes it, from the norm read to the host; 1.0 for a non-finite norm (nothing is scaled)."""
    if not math.isfinite(norm):
        return 1.0
    host = torch.tensor(norm, dtype=dtype, device="cpu")
    return float(torch.clamp(max_norm / (host + 1e-6), max=1.0))


def scale_(grads: Iterable[Optional[torch.Tensor]], coef: float) -> None:
    """Scale ``grads`` in place by ``coef`` (``clip_coef``); nothing to do at 1.0."""
    if coef >= 1.0:
        return
    for g in grads:
        if g is not None:
            g.mul_(coef)
