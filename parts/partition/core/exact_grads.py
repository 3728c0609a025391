"""Reproducible mode's reduce-scatter: full grads to grad shards as int64 sums (core/exact.py).

Each rank's full grad of a parameter is its unit's (its micro-batch's). The rank quantizes it
at the exponent its own largest magnitude gives (``parts.base.fixed_point``) and sends it in one
int64 reduce-scatter with one tag word per parameter (``parts.base.unit_tags``, summed like the
data): from their sums every rank sees whether all units of a parameter had one exponent,
nearly always the case since exponents are multiples of 16 bits; then the int64 sum it received
is exact. Parameters whose units had several exponents are reduced again, one reduce-scatter
per exponent present but the highest, whose sum is what is left of the first
(``_by_exponent``). Integer sums are exact in any order, so what each rank receives is the
same whatever the world size and however the units are paired. The sums are added to the
parameter's ``ExactGrad`` and the grad shard is written from them; no division by the world
size (each unit's loss carries its ``1 / units`` scale: ``parts.partition.reproducible``).
The full grads stay alive until the reduce-scatter is waited for (the second round needs them).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from parts.base.fixed_point import GRID, largest, rounded, unit_exponent
from parts.base.unit_tags import tag, tag_words, untag
from parts.comm import GroupArg, max_everywhere, reduce_scatter_many
from parts.partition.core import exact
from parts.partition.core.exact import NONE
from parts.partition.core.grads import ReduceHandle
from parts.partition.core.param import ParamMeta, alloc, common_info, metas_sorted
from parts.partition.core.replicas import mark_pending

CHUNK = 1 << 18
"""Elements quantized at once into a send buffer: the float intermediate stays in cache."""


def _local(grads: list[torch.Tensor]) -> list[tuple[Optional[int], bool]]:
    """``(exponent or None for zeros, nonfinite)`` of each of this unit's full grads."""
    out = []
    for top in largest(grads):
        bad = top != top or top == float("inf")
        out.append((None, True) if bad else (unit_exponent(top), False))
    return out


def _send(grad: torch.Tensor, own: Optional[int], exponent: int, m: ParamMeta, world: int) -> torch.Tensor:
    """The int64 send buffer of ``world * shard_numel`` elements: the grad quantized at ``exponent``
    if that is this unit's, else zeros (padding zeroed)."""
    send = alloc(world * m.layout.shard_numel, torch.int64, m.device)
    if own is not None and own == exponent:
        if m.numel <= CHUNK:
            send[:m.numel].copy_(rounded(grad, exponent))  # integers below 2**50: exact in int64
        else:
            for part, out in zip(grad.split(CHUNK), send[:m.numel].split(CHUNK)):  # in cache-sized pieces
                out.copy_(rounded(part, exponent))
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
    local = _local(grads)
    records = [m for _, m in pairs]
    states = [exact.begin(m, info.world_size) for m in records]
    sends = [_send(g, e, e, m, info.world_size) for g, (e, _), m in zip(grads, local, records)]
    recvs = [alloc(m.layout.shard_numel, torch.int64, m.device) for m in records]
    tags = _tags(local, info.world_size, records[0].device)
    tag_sums = torch.empty(tags.shape[1], dtype=torch.int64, device=tags.device)
    work = reduce_scatter_many([*recvs, tag_sums], [*sends, tags.reshape(-1)], info, async_op=True)
    del sends

    def finish() -> None:
        mixed, per, sums = [], tag_words(info.world_size), tag_sums.tolist()
        for i in range(len(records)):
            units, bad, one = untag(sums[i * per:(i + 1) * per], info.world_size)
            if bad:
                states[i].nonfinite = True
            elif one is not None:  # every unit at one exponent: the sum is exact
                exact.add(states[i], one, recvs[i])
            elif units:
                mixed.append(i)
        if mixed:  # units at several exponents (the same list on every rank): one sum per exponent
            _by_exponent([grads[i] for i in mixed], [local[i] for i in mixed], [states[i] for i in mixed],
                         [records[i] for i in mixed], info, [recvs[i] for i in mixed])
        for m, state in zip(records, states):
            exact.land(m, exact.value(state, m.layout.shard_numel, m.device))
        mark_pending(records)  # a hybrid layout: the replicas' sums at the step (core/exact.py)

    handle = ReduceHandle(work, finish)
    if async_op:
        return handle
    handle.wait()
    return None


def _tags(local: list, world: int, device: torch.device) -> torch.Tensor:
    """``world`` copies (one per destination) of each parameter's tag words (``unit_tags.tag``):
    summed over ranks they say whether every unit has one exponent and which."""
    words = [w for e, bad in local for w in tag(e, bad, world)]
    return torch.tensor(words, dtype=torch.int64).reshape(1, -1).expand(world, -1).contiguous().to(device)


def _by_exponent(grads: list, local: list, states: list, records: list, info: object,
                 mixed_sums: list) -> None:
    """The sums of parameters whose units have several exponents: one MAX all-reduce for the lowest
    and highest, one int64 reduce-scatter per exponent below the highest (zeros from a unit at
    another); the highest one's sum is the first round's ``mixed_sums`` less those (exact integers)."""
    n = len(records)
    agreed = max_everywhere([e if e is not None else NONE for e, _ in local]
                            + [-e if e is not None else NONE for e, _ in local], info)
    rest = [s.clone() for s in mixed_sums]
    plan = [(i, e) for i in range(n) for e in range(-agreed[n + i], agreed[i], GRID)]
    for e in sorted({e for _, e in plan}):
        members = [i for i, pe in plan if pe == e]
        sends = [_send(grads[i], local[i][0], e, records[i], info.world_size) for i in members]
        recvs = [alloc(records[i].layout.shard_numel, torch.int64, records[i].device) for i in members]
        reduce_scatter_many(recvs, sends, info)
        for i, part in zip(members, recvs):
            rest[i].sub_(part)
            exact.add(states[i], e, part)
    for i in range(n):
        exact.add(states[i], agreed[i], rest[i])


def _full(p: nn.Parameter, m: ParamMeta) -> torch.Tensor:
    """``p``'s full grad as a flat tensor, its element count checked."""
    grad = p.grad.detach().reshape(-1)
    if grad.numel() != m.numel:
        raise RuntimeError(f"reduce_scatter_exact: {m.describe()} has a grad of {grad.numel()} elements, "
                           f"expected {m.numel}")
    return grad
