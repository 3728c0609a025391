"""Reproducible mode's grad shards: int64 sums per exponent (``parts.base.fixed_point``).

A parameter of a model attached with ``reproducible=True`` carries an ``ExactGrad`` on its
record (``meta(p).exact``). Every reduce-scatter of its grad (core/exact_grads.py) adds the
int64 sums of that micro-batch's units into it, and then rewrites the grad shard from all the
sums (``land``): never a float accumulation, so the grad shard after the last micro-batch is a
function of the set of units alone. The sums start again once the grad shard was cleared
(``optimizer.zero_grad()``, set to None or zeroed); a grad shard changed otherwise between two
backwards (scaled by a clip, written by hand) raises, since the sums would no longer say what
it holds.

In a hybrid layout the sums are this replica's; ``sum_replicas`` adds them across replicas
(an int64 all-reduce per exponent present) and lands the total, leaving the replica's own
sums as they are, so micro-batches after it add to them and a later sum is again complete.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch

from parts.base.fixed_point import GRID, MAX_UNITS, dequantize
from parts.comm import all_reduce, group_key, max_everywhere
from parts.partition.core import disk
from parts.partition.core.param import ParamMeta

NONE = -(1 << 40)
"""The agreed value of an exponent no unit has (below every real one)."""


@dataclass(eq=False)
class ExactGrad:
    """One parameter's fixed-point grad: int64 shard sums per exponent since its grad shard was cleared."""

    dtype: torch.dtype  # the grad shard's dtype
    sums: dict = field(default_factory=dict)  # exponent -> int64 tensor of shard_numel elements
    nonfinite: bool = False  # a unit had an inf or nan: the grad shard is nan
    units: int = 0  # units summed (the bound of ``MAX_UNITS``)
    written: Any = field(default=None, repr=False)  # weakref to the grad shard ``land`` wrote last
    version: int = -1  # its version counter right after


def enable(records: Iterable[ParamMeta], dtype_of: Any) -> None:
    """Give each record an ``ExactGrad`` whose grad shard dtype is ``dtype_of(record)``."""
    for m in records:
        m.exact = ExactGrad(dtype_of(m))


def disable(records: Iterable[ParamMeta]) -> None:
    """Back to floating-point grad sums."""
    for m in records:
        m.exact = None


def begin(m: ParamMeta, units: int) -> ExactGrad:
    """``m``'s sums, ready to receive ``units`` more units (emptied first if the grad shard was cleared)."""
    state = m.exact
    if _cleared(m, state):
        state.sums, state.nonfinite, state.units = {}, False, 0
    state.units += units
    if state.units > MAX_UNITS:
        raise RuntimeError(f"reproducible mode: {m.describe()} sums {state.units} units (micro-batches "
                           f"times ranks) since its grad was cleared; one fixed-point sum holds at most "
                           f"{MAX_UNITS}: call optimizer.zero_grad() between steps")
    return state


def _cleared(m: ParamMeta, state: ExactGrad) -> bool:
    """True if ``m``'s grad shard is gone or zeroed since ``land`` wrote it; raises if it was changed
    otherwise (the sums would no longer say what it holds)."""
    if disk.parked_version(m.shard) is not None:  # a grad in a DiskStore: cleared by zero_grad
        return not disk.has_grad(m.shard)
    grad = m.grad_shard
    if grad is None:
        return True
    if state.written is not None and state.written() is grad and grad._version == state.version:
        return False
    if not bool(grad.count_nonzero()):
        return True
    raise RuntimeError(f"reproducible mode: the grad shard of {m.describe()} was changed outside the "
                       f"gradient reduction (scaled or written) and is not zero; clear it with "
                       f"optimizer.zero_grad() before the next backward")


def add(state: ExactGrad, exponent: int, part: torch.Tensor) -> None:
    """Add the int64 ``part`` (a reduce-scattered sum at ``exponent``) into ``state``'s sums."""
    current = state.sums.get(exponent)
    if current is None:
        state.sums[exponent] = part
    else:
        current.add_(part)


def value(state: ExactGrad, numel: int, device: torch.device, sums: Optional[dict] = None,
          nonfinite: Optional[bool] = None) -> torch.Tensor:
    """The grad shard that ``sums`` (default: ``state``'s) stand for, in ``state.dtype``; nan where a unit
    was not finite."""
    if state.nonfinite if nonfinite is None else nonfinite:
        return torch.full((numel,), float("nan"), dtype=state.dtype, device=device)
    return dequantize(state.sums if sums is None else sums, state.dtype, numel, device)


def land(m: ParamMeta, shard_value: torch.Tensor) -> None:
    """Write ``shard_value`` as ``m``'s grad shard (replacing it: in memory or in a ``DiskStore``)."""
    state = m.exact
    if disk.accumulate_grad(m.shard, shard_value, False):
        return
    current = m.grad_shard
    if current is None:
        m.grad_shard = shard_value.to(m.shard.device, torch.promote_types(shard_value.dtype, m.shard.dtype))
        current = m.grad_shard
    else:
        current.copy_(shard_value)
    state.written, state.version = weakref.ref(current), current._version


def sum_replicas(records: list[ParamMeta]) -> None:
    """Add the replicas' sums of ``records`` (in id order, one replica group) and land the totals;
    every member of the group calls it with the same records."""
    info = records[0].replica
    for m in records:
        if m.exact.units * info.world_size > MAX_UNITS:
            raise RuntimeError(f"reproducible mode: {m.describe()} sums more than {MAX_UNITS} units "
                               f"across its {info.world_size} replicas; call optimizer.zero_grad() between steps")
    local = [_span(m.exact) for m in records]
    agreed = max_everywhere([v for row in local for v in row], info)
    spans = [agreed[3 * i:3 * i + 3] for i in range(len(records))]
    totals: list[dict] = [{} for _ in records]
    for exponent in sorted({e for hi, low, _ in spans if hi != NONE for e in range(-low, hi + 1, GRID)}):
        members = [i for i, (hi, low, _) in enumerate(spans) if hi != NONE and -low <= exponent <= hi]
        parts = [_sum_at(records[i], exponent) for i in members]
        flat = all_reduce(torch.cat(parts), info)
        for i, part in zip(members, flat.split([p.numel() for p in parts])):
            totals[i][exponent] = part
    for m, total, (_, _, bad) in zip(records, totals, spans):
        land(m, value(m.exact, m.layout.shard_numel, m.device, total, bool(bad)))


def _span(state: ExactGrad) -> list[int]:
    """``span`` of ``state``'s sums."""
    return span(state.sums, state.nonfinite)


def span(sums: dict, nonfinite: bool) -> list[int]:
    """``[highest exponent, -lowest exponent, nonfinite]`` of ``sums`` (``NONE`` for none), for one
    MAX all-reduce that gives every rank the range of exponents any rank has."""
    if not sums:
        return [NONE, NONE, int(nonfinite)]
    return [max(sums), -min(sums), int(nonfinite)]


def _sum_at(m: ParamMeta, exponent: int) -> torch.Tensor:
    """A copy of ``m``'s sum at ``exponent`` (zeros if it has none) to all-reduce."""
    current = m.exact.sums.get(exponent)
    if current is None:
        return torch.zeros(m.layout.shard_numel, dtype=torch.int64, device=m.device)
    return current.clone()


def group_of(m: ParamMeta) -> str:
    """The key of ``m``'s replica group (records of one group sum together)."""
    return group_key(m.replica)
