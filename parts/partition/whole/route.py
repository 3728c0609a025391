"""``route``: settle which path an optimizer over shards takes, once, before it first steps.

Called by the process-wide step pre-hook (core/steps.py) before every step, by the ``parts``
functions that read an optimizer's param groups, and by users who name a path themselves.
The first call finds the sharded parameters among the optimizer's tensors (its shards and
``ShapedShard`` leaves), chooses a path (whole/paths.py) and rewrites the param groups: the
shard path puts the shards themselves there; the whole-tensor path hands the parameters to a
``WholeStepper`` (whole/stepper.py). Later calls cost one dictionary lookup.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from parts.base.wrapper import OptimizerWrapper, on_wrap
from parts.partition.core import steps
from parts.partition.whole.leaves import record_of_leaf
from parts.partition.whole.paths import SHARD, WHOLE, choose
from parts.partition.whole.stepper import WholeStepper

_routed = WeakIdKeyDictionary()
"""Optimizer -> (path, its WholeStepper or None): what ``route`` settled; forgets dead optimizers."""


def _record_of(t: Any) -> tuple[Optional[Any], bool]:
    """(record, is the shard itself or a leaf over it) of a tensor an optimizer holds."""
    record = record_of_leaf(t)
    if record is not None:
        return record, True
    record = steps.linked_record(t)
    if record is None:
        return None, False
    return record, record.shard is t


def _slots(optimizer: torch.optim.Optimizer) -> list[tuple[int, int, Any, bool]]:
    """(group, position, record, own shard) of every tensor of a sharded parameter in the groups."""
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for i, t in enumerate(group["params"]):
            record, own = _record_of(t)
            if record is not None:
                out.append((g, i, record, own))
    return out


def _masters_message(optimizer: torch.optim.Optimizer, record: Any) -> str:
    return (f"parts.partition: {type(optimizer).__name__} needs whole tensors, but it steps a copy of "
            f"{record.describe()} that a wrapper keeps (BF16Optimizer's fp32 masters) flat; keep fp32 "
            f"shards as the masters instead: attach(model, mixed_precision=MixedPrecision()) and "
            f"{type(optimizer).__name__}(shards(model)), bf16 on the wire and in compute")


def route(optimizer: torch.optim.Optimizer, path: Optional[str] = None) -> str:
    """Settle (once) and return the path ``optimizer`` takes over its shards: "shard" or "whole";
    ``path`` overrides the choice (before the optimizer first steps)."""
    if isinstance(optimizer, OptimizerWrapper):
        return route(optimizer.optimizer, path)
    settled = _routed.get(optimizer)
    if settled is not None:
        if path is not None and path != settled[0]:
            raise RuntimeError(f"parts.partition.route: {type(optimizer).__name__} already takes the {settled[0]} "
                               f"path; name the path right after building the optimizer, before it steps")
        return settled[0]
    slots = _slots(optimizer)
    if not slots:
        _routed[optimizer] = (SHARD, None)
        return SHARD
    chosen = choose(optimizer, path)
    if chosen == WHOLE:
        for _, _, record, own in slots:
            if not own:
                raise RuntimeError(_masters_message(optimizer, record))
    if chosen == WHOLE and any(optimizer.state.get(optimizer.param_groups[g]["params"][i]) for g, i, _, _ in slots):
        raise RuntimeError(f"parts.partition: {type(optimizer).__name__} has state for its shards before its path "
                           f"was settled; call parts.partition.route(optimizer) right after building it")
    stepper = WholeStepper(optimizer, [record for _, _, record, _ in slots]) if chosen == WHOLE else None
    for g, i, record, own in slots:
        params = optimizer.param_groups[g]["params"]
        old = params[i]
        params[i] = stepper.by_record[id(record)] if stepper is not None else (record.shard if own else old)
        if params[i] is not old and old in optimizer.state:  # state loaded before the first step: the shard's
            optimizer.state[params[i]] = optimizer.state.pop(old)
    _routed[optimizer] = (chosen, stepper)
    return chosen


def stepper_of(optimizer: torch.optim.Optimizer) -> Optional[WholeStepper]:
    """The ``WholeStepper`` of a routed optimizer on the whole-tensor path, else None."""
    settled = _routed.get(optimizer)
    return settled[1] if settled is not None else None


class _Router:
    """What the step hooks of core/steps.py call for every optimizer."""

    def resolve(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, OptimizerWrapper) and optimizer not in _routed:
            route(optimizer)

    def before(self, optimizer: torch.optim.Optimizer) -> None:
        stepper = stepper_of(optimizer)
        if stepper is not None:
            stepper.before()

    def after(self, optimizer: torch.optim.Optimizer) -> None:
        stepper = stepper_of(optimizer)
        if stepper is not None:
            stepper.after()

    def held(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        stepper = stepper_of(optimizer)
        return [m.shard for m in stepper.records] if stepper is not None else []


def _settle_wrapped(optimizer: torch.optim.Optimizer, wrapper: torch.optim.Optimizer) -> None:
    """Settle the path of an optimizer a wrapper is about to read; refuse the whole-tensor path there."""
    if route(optimizer) == WHOLE:
        name, outer = type(optimizer).__name__, type(wrapper).__name__
        raise RuntimeError(f"parts.partition: {outer} wraps {name}, which needs whole tensors (its parameters are "
                           f"stepped whole by owner ranks, with state in memory); {outer} steps flat copies or "
                           f"chunks and would give another result. Step {name}(shards(model)) unwrapped: fp32 "
                           f"shards are the masters, attach(model, mixed_precision=MixedPrecision()) gives bf16 "
                           f"compute, and parts.partition.clip_grad_norm_(model, ...) clips before the step")


steps.set_router(_Router())
on_wrap(_settle_wrapped)
