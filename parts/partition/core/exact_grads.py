"""Reproducible mode's grad reduction: full grads to grad shards as int64 sums (core/exact.py).

Each rank's full grad of a parameter is its unit's (its micro-batch's). The rank finds the
exponent its unit quantizes each grad at, from the grad's own largest magnitude
(``parts.base.fixed_point``), and sends every rank that rank's chunk of its grads as they
are, in their float dtype, in one all-to-all per bucket, the exponent codes of its grads beside
them: the bytes of the default mode's reduce-scatter on gloo (there a direct exchange too).
Each rank then quantizes every chunk it received at its unit's exponent and adds the integers,
one sum per exponent present. Quantizing is element-wise, so a chunk quantized on its receiver
is the same integers as those elements of the whole grad quantized on its sender; integer sums
are exact in any order, so what each rank sums is the same whatever the world size and however
the units are paired. The sums are added to the parameter's ``ExactGrad`` and the grad shard is
written from them; no division by the world size (each unit's loss carries its ``1 / units``
scale: ``parts.partition.reproducible``). The full grads are freed once they are packed.
"""

from __future__ import annotations

from functools import reduce
from typing import Iterable, Optional

import torch
from torch import nn

from parts.base.fixed_point import GRID, largest, piece_scales, quantized_row_sum, unit_exponent
from parts.comm import GroupArg, all_to_all
from parts.partition.core import exact
from parts.partition.core.exact import ExactGrad
from parts.partition.core.grads import ReduceHandle
from parts.partition.core.param import ParamMeta, alloc, common_info, metas_sorted
from parts.partition.core.replicas import mark_pending

CHUNK = 1 << 18
"""Elements quantized at once: the float intermediate stays in cache."""
ZERO = 127.0
"""The code of an all-zero grad (exponent codes ``e / GRID`` lie in ``[-61, 60]``; every float
dtype holds both exactly); a grad holding an inf or nan is coded nan."""


def reduce_scatter_exact(params: Iterable[nn.Parameter], group: GroupArg = None, *,
                         async_op: bool = False) -> Optional[ReduceHandle]:
    """Reduce-scatter (sum) the full ``p.grad`` of ``params`` in fixed point into their grad shards,
    freeing ``p.grad``; every param must carry an ``ExactGrad`` (``attach(model, reproducible=True)``)."""
    pairs = [(p, m) for p, m in metas_sorted(params) if p.grad is not None]
    info = common_info(pairs, group, "reduce_scatter_exact")
    if not pairs:
        return ReduceHandle(None, lambda: None) if async_op else None
    records = [m for _, m in pairs]
    grads = [_full(p, m) for p, m in pairs]
    for p, _ in pairs:
        p.grad = None
    states = [exact.begin(m, info.world_size) for m in records]
    send = _pack(grads, records, _codes(grads), info.world_size)
    del grads
    recv = torch.empty_like(send)
    width = send.shape[1]
    work = all_to_all(recv.view(-1), send.view(-1), [width] * info.world_size, [width] * info.world_size,
                      info, async_op=True)
    del send

    def finish() -> None:
        _sum_received(recv, records, states)
        for m, state in zip(records, states):
            exact.land(m, exact.value(state, m.layout.shard_numel, m.device))
        mark_pending(records)  # a hybrid layout: the replicas' sums at the step (core/exact.py)

    handle = ReduceHandle(work, finish)
    if async_op:
        return handle
    handle.wait()
    return None


def _codes(grads: list[torch.Tensor]) -> list[float]:
    """Each full grad's exponent code: ``e / GRID`` of its unit exponent, ``ZERO``, or nan if not finite."""
    codes = []
    for top in largest(grads):
        if top != top or top == float("inf"):
            codes.append(float("nan"))
            continue
        exponent = unit_exponent(top)
        codes.append(ZERO if exponent is None else float(exponent // GRID))
    return codes


def _pack(grads: list[torch.Tensor], records: list[ParamMeta], codes: list[float], world: int) -> torch.Tensor:
    """The send buffer, one row per destination rank: its chunk of every grad (zero padded), then
    the codes; in the grads' common dtype (a widening cast is exact)."""
    dtype = reduce(torch.promote_types, (g.dtype for g in grads))
    width = sum(m.layout.shard_numel for m in records) + len(records)
    send = alloc(world * width, dtype, records[0].device).view(world, width)
    offset = 0
    for grad, m in zip(grads, records):
        _chunks(send[:, offset:offset + m.layout.shard_numel], grad)
        offset += m.layout.shard_numel
    send[:, offset:].copy_(torch.tensor(codes, dtype=dtype).expand(world, -1))
    return send


def _chunks(block: torch.Tensor, grad: torch.Tensor) -> None:
    """Lay the flat ``grad`` out as ``block``'s rows of one chunk each, the rest zeros."""
    size = block.shape[1]
    if size == 0:
        return
    full, rest = divmod(grad.numel(), size)
    block[:full].copy_(grad[:full * size].view(full, size))
    if full < block.shape[0]:
        block[full, :rest].copy_(grad[full * size:])
        block[full, rest:].zero_()
        block[full + 1:].zero_()


def _sum_received(recv: torch.Tensor, records: list[ParamMeta], states: list[ExactGrad]) -> None:
    """Quantize the chunks every rank sent at their units' exponents and add them into ``states``:
    the parameters whose units all have one exponent in one pass over the rows, the others one by one."""
    sizes = [m.layout.shard_numel for m in records]
    data = sum(sizes)
    columns = list(zip(*recv[:, data:].tolist()))  # each parameter's codes, one per rank
    agreed = [_agreed(column) for column in columns]
    totals = quantized_row_sum(recv[:, :data], piece_scales(agreed, sizes, recv.device), CHUNK)
    offset = 0
    for state, size, column, exponent in zip(states, sizes, columns, agreed):
        if exponent is not None:
            exact.add(state, exponent, totals[offset:offset + size])
        else:
            _add_mixed(state, column, recv[:, offset:offset + size])
        offset += size


def _agreed(column: tuple) -> Optional[int]:
    """The exponent every unit of a parameter quantizes at, or None (several, a zero or nonfinite grad)."""
    first = column[0]
    if first != first or first == ZERO or any(code != first for code in column):
        return None
    return int(first) * GRID


def _add_mixed(state: ExactGrad, column: tuple, chunks: torch.Tensor) -> None:
    """Add a parameter's chunks whose units differ (several exponents, zero or nonfinite grads): one
    sum per exponent present; a nonfinite unit makes the grad nan."""
    by_exponent: dict[int, list[int]] = {}
    for rank, code in enumerate(column):
        if code != code:
            state.nonfinite = True
        elif code != ZERO:
            by_exponent.setdefault(int(code) * GRID, []).append(rank)
    if state.nonfinite:
        return
    for exponent, ranks in by_exponent.items():
        rows = chunks[ranks]
        exact.add(state, exponent, quantized_row_sum(rows, piece_scales([exponent], [rows.shape[1]], rows.device),
                                                     CHUNK))


def _full(p: nn.Parameter, m: ParamMeta) -> torch.Tensor:
    """``p``'s full grad as a flat tensor, its element count checked."""
    grad = p.grad.detach().reshape(-1)
    if grad.numel() != m.numel:
        raise RuntimeError(f"reduce_scatter_exact: {m.describe()} has a grad of {grad.numel()} elements, "
                           f"expected {m.numel}")
    return grad
