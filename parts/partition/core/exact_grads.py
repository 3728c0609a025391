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

Over a group with a topology (``parts.comm.topology``: several nodes) the exchange takes two
hops, so that each node's sums cross between nodes once, as the default reduce-scatter's do:
the all-to-all runs within the node (local rank ``i`` receives its node's pieces for local
rank ``i`` of every node and sums them per exponent), then the int64 sums are reduce-scattered
across the nodes, one per exponent any node has (their span agreed by a MAX all-reduce).
"""

from __future__ import annotations

from functools import reduce
from typing import Iterable, Optional

import torch
from torch import nn

from parts.base.fixed_point import GRID, largest, piece_scales, quantized_row_sum, unit_exponent
from parts.comm import GroupArg, GroupInfo, all_to_all, max_everywhere, reduce_scatter_many
from parts.partition.core import exact
from parts.partition.core.exact import NONE, ExactGrad
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
    topo = info.topology if info.world_size > 1 else None
    nodes, peers = (topo.nodes, topo.per_node) if topo is not None else (1, info.world_size)
    send = _pack(grads, records, _codes(grads), nodes, peers)
    del grads
    recv = torch.empty_like(send)
    width = send.shape[1]
    work = all_to_all(recv.view(-1), send.view(-1), [width] * peers, [width] * peers,
                      info if topo is None else topo.node, async_op=True)
    del send

    def finish() -> None:
        sums = _received_sums(recv, [nodes * m.layout.shard_numel for m in records])
        if topo is None:
            _add(states, sums)
        else:  # this rank holds its pieces for every node: sum them across the nodes
            _across_nodes(sums, records, states, topo.across)
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


def _pack(grads: list[torch.Tensor], records: list[ParamMeta], codes: list[float], nodes: int,
          peers: int) -> torch.Tensor:
    """The send buffer, one row per peer (local rank ``i`` of ``peers`` on each of ``nodes`` nodes; one
    node: the group rank): the chunk of every grad for group rank ``n * peers + i`` of each node
    ``n`` (zero padded), then the codes; in the grads' common dtype (a widening cast is exact)."""
    dtype = reduce(torch.promote_types, (g.dtype for g in grads))
    width = nodes * sum(m.layout.shard_numel for m in records) + len(records)
    send = alloc(peers * width, dtype, records[0].device).view(peers, width)
    offset = 0
    for grad, m in zip(grads, records):
        size = m.layout.shard_numel
        if nodes == 1:
            _chunks(send[:, offset:offset + size], grad)
        else:
            blocks = send[:, offset:offset + nodes * size].view(peers, nodes, size)
            for node in range(nodes):
                _chunks(blocks[:, node], grad[node * peers * size:(node + 1) * peers * size])
        offset += nodes * size
    send[:, offset:].copy_(torch.tensor(codes, dtype=dtype).expand(peers, -1))
    return send


def _chunks(block: torch.Tensor, grad: torch.Tensor) -> None:
    """Lay the flat ``grad`` (a piece, maybe short or empty) out as ``block``'s rows of one chunk each,
    the rest zeros."""
    size = block.shape[1]
    if size == 0:
        return
    full, rest = divmod(grad.numel(), size)
    block[:full].copy_(grad[:full * size].view(full, size))
    if full < block.shape[0]:
        block[full, :rest].copy_(grad[full * size:])
        block[full, rest:].zero_()
        block[full + 1:].zero_()


def _received_sums(recv: torch.Tensor, sizes: list[int]) -> list[Optional[dict]]:
    """Each parameter's received pieces (``sizes`` elements per row), quantized at their units'
    exponents and summed over the rows: ``{exponent: int64 sum}`` (empty: all zero), or None where
    a unit was not finite. Parameters whose units all share one exponent in one pass over the rows."""
    data = sum(sizes)
    columns = list(zip(*recv[:, data:].tolist()))  # each parameter's codes, one per row
    agreed = [_agreed(column) for column in columns]
    totals = quantized_row_sum(recv[:, :data], piece_scales(agreed, sizes, recv.device), CHUNK)
    out: list[Optional[dict]] = []
    offset = 0
    for size, column, exponent in zip(sizes, columns, agreed):
        if exponent is not None:
            out.append({exponent: totals[offset:offset + size]})
        else:
            out.append(_mixed_sums(column, recv[:, offset:offset + size]))
        offset += size
    return out


def _agreed(column: tuple) -> Optional[int]:
    """The exponent every unit of a parameter quantizes at, or None (several, a zero or nonfinite grad)."""
    first = column[0]
    if first != first or first == ZERO or any(code != first for code in column):
        return None
    return int(first) * GRID


def _mixed_sums(column: tuple, chunks: torch.Tensor) -> Optional[dict]:
    """The sums of a parameter's rows whose units differ (several exponents, zero grads), one per
    exponent present; None if a unit was not finite."""
    by_exponent: dict[int, list[int]] = {}
    for row, code in enumerate(column):
        if code != code:
            return None
        if code != ZERO:
            by_exponent.setdefault(int(code) * GRID, []).append(row)
    sums = {}
    for exponent, rows in by_exponent.items():
        part = chunks[rows]
        sums[exponent] = quantized_row_sum(part, piece_scales([exponent], [part.shape[1]], part.device), CHUNK)
    return sums


def _add(states: list[ExactGrad], sums: list[Optional[dict]]) -> None:
    """Add each parameter's sums into its ``ExactGrad`` (None: a unit was not finite, the grad is nan)."""
    for state, parts in zip(states, sums):
        if parts is None:
            state.nonfinite = True
            continue
        for exponent, part in parts.items():
            exact.add(state, exponent, part)


def _across_nodes(sums: list[Optional[dict]], records: list[ParamMeta], states: list[ExactGrad],
                  across: GroupInfo) -> None:
    """The second hop over a group with a topology: this node's sums of this rank's pieces for every
    node, reduce-scattered in int64 over ``across`` (this local rank on every node), one sum per
    exponent any node has (their span agreed by one MAX all-reduce), into ``states``."""
    agreed = max_everywhere([v for parts in sums for v in exact.span(parts or {}, parts is None)], across)
    outs, ins, where = [], [], []
    for i, (parts, m) in enumerate(zip(sums, records)):
        high, low, bad = agreed[3 * i:3 * i + 3]
        if bad or high == NONE:
            states[i].nonfinite = states[i].nonfinite or bool(bad)
            continue
        for exponent in range(-low, high + 1, GRID):
            part = (parts or {}).get(exponent)
            ins.append(part if part is not None else torch.zeros(across.world_size * m.layout.shard_numel,
                                                                dtype=torch.int64, device=m.device))
            outs.append(alloc(m.layout.shard_numel, torch.int64, m.device))
            where.append((i, exponent))
    if outs:
        reduce_scatter_many(outs, ins, across)
    _add([states[i] for i, _ in where], [{e: out} for (_, e), out in zip(where, outs)])


def _full(p: nn.Parameter, m: ParamMeta) -> torch.Tensor:
    """``p``'s full grad as a flat tensor, its element count checked."""
    grad = p.grad.detach().reshape(-1)
    if grad.numel() != m.numel:
        raise RuntimeError(f"reduce_scatter_exact: {m.describe()} has a grad of {grad.numel()} elements, "
                           f"expected {m.numel}")
    return grad
