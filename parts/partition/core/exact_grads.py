"""Reproducible mode's reduce-scatter: full grads to grad shards as int64 sums (core/exact.py).

Each rank's full grad of a parameter is its unit's (its micro-batch's). The rank quantizes it
at the exponent its own largest magnitude gives (``parts.base.fixed_point``); one MAX
all-reduce over the bucket's parameters tells every rank the lowest and highest exponent any
rank uses. Then one int64 reduce-scatter per exponent present, over the parameters that have
it (a rank whose unit has another exponent sends zeros there): nearly always one, since
exponents are multiples of 16 bits. Integer sums are exact in any order, so what each rank
receives is the same whatever the world size and however the units are paired. The sums are
added to the parameter's ``ExactGrad`` and the grad shard is written from them; no division
by the world size (each unit's loss carries its ``1 / units`` scale: ``parts.partition.units``).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from parts.base.fixed_point import GRID, quantize, unit_exponent
from parts.comm import GroupArg, WorkList, max_everywhere, reduce_scatter_many
from parts.partition.core import exact
from parts.partition.core.exact import NONE
from parts.partition.core.grads import ReduceHandle
from parts.partition.core.param import ParamMeta, alloc, common_info, metas_sorted
from parts.partition.core.replicas import mark_pending


def _local(grad: torch.Tensor) -> tuple[Optional[int], bool]:
    """``(exponent or None for zeros, nonfinite)`` of one unit's full grad."""
    top = float(grad.abs().max()) if grad.numel() else 0.0
    if top != top or top == float("inf"):
        return None, True
    return unit_exponent(top), False


def _send(grad: torch.Tensor, own: Optional[int], exponent: int, m: ParamMeta, world: int) -> torch.Tensor:
    """The int64 send buffer of ``world * shard_numel`` elements: the grad quantized at ``exponent``
    if that is this unit's, else zeros (padding zeroed)."""
    send = alloc(world * m.layout.shard_numel, torch.int64, m.device)
    if own == exponent:
        send[:m.numel].copy_(quantize(grad, exponent))
        send[m.numel:].zero_()
    else:
        send.zero_()
    return send


def reduce_scatter_exact(params: Iterable[nn.Parameter], group: GroupArg = None, *,
                         async_op: bool = False) -> Optional[ReduceHandle]:
    """Reduce-scatter (sum) the full ``p.grad`` of ``params`` in fixed point into their grad shards,
    freeing ``p.grad``; every param must carry an ``ExactGrad`` (``attach(model, reproducible=True)``)."""
    pairs = [(p, m) for p, m in metas_sorted(params) if p.grad is not None]
    info = common_info(pairs, group, "reduce_scatter_exact")
    if not pairs:
        return ReduceHandle(None, lambda: None) if async_op else None
    grads = [_full(p, m) for p, m in pairs]
    for p, _ in pairs:
        p.grad = None
    local = [_local(g) for g in grads]
    agreed = max_everywhere([e if e is not None else NONE for e, _ in local]
                            + [-e if e is not None else NONE for e, _ in local]
                            + [int(bad) for _, bad in local], info)
    n = len(pairs)
    states = [exact.begin(m, info.world_size) for _, m in pairs]
    plan = []  # (index, exponent) of each reduce-scatter slice
    for i in range(n):
        high, low, bad = agreed[i], agreed[n + i], agreed[2 * n + i]
        if bad:
            states[i].nonfinite = True
        elif high != NONE:
            plan += [(i, e) for e in range(-low, high + 1, GRID)]
    works, landed = [], []
    for e in sorted({e for _, e in plan}):  # one int64 reduce-scatter per exponent present
        members = [i for i, pe in plan if pe == e]
        sends = [_send(grads[i], local[i][0], e, pairs[i][1], info.world_size) for i in members]
        recvs = [alloc(pairs[i][1].layout.shard_numel, torch.int64, pairs[i][1].device) for i in members]
        works.append(reduce_scatter_many(recvs, sends, info, async_op=True))
        landed += [(i, e, r) for i, r in zip(members, recvs)]

    def finish() -> None:
        for i, e, part in landed:
            exact.add(states[i], e, part)
        records = [m for _, m in pairs]
        for m, state in zip(records, states):
            exact.land(m, exact.value(state, m.layout.shard_numel, m.device))
        mark_pending(records)  # a hybrid layout: the replicas' sums at the step (core/exact.py)

    handle = ReduceHandle(WorkList(works), finish)
    if async_op:
        return handle
    handle.wait()
    return None


def _full(p: nn.Parameter, m: ParamMeta) -> torch.Tensor:
    """``p``'s full grad as a flat tensor, its element count checked."""
    grad = p.grad.detach().reshape(-1)
    if grad.numel() != m.numel:
        raise RuntimeError(f"reduce_scatter_exact: {m.describe()} has a grad of {grad.numel()} elements, "
                           f"expected {m.numel}")
    return grad
