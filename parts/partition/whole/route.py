"""``route``: settle which path an optimizer over shards takes, once, before it first steps.

Called by the process-wide step pre-hook (core/steps.py) before every step, by the ``parts``
functions that read an optimizer's param groups, and by users who name a path themselves.
The first call finds the sharded parameters among the optimizer's tensors (its shards and
``ShapedShard`` leaves), chooses a path (whole/paths.py; the ranks agree on the strictest of
their answers) and rewrites the param groups: the shard path puts the shards themselves there;
the whole path hands the parameters to a ``WholeStepper`` (whole/stepper.py), the replicated
path to a ``ReplicatedStepper`` (whole/replicated.py). A wrapper that shares its param groups
with the optimizers it holds (Lookahead, SAM) is routed as one with them: the outermost
optimizer's step runs the exchanges, and state any of them made already is carried over
(whole/early_state.py). Later calls cost one dictionary lookup.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from parts.base.wrapper import OptimizerWrapper, on_wrap
from parts.comm import GroupInfo, ReduceOp, all_reduce, comm_device
from parts.partition.core import steps
from parts.partition.whole import closures
from parts.partition.whole.early_state import carry
from parts.partition.whole.full import FullStepper
from parts.partition.whole.leaves import record_of_leaf
from parts.partition.whole.paths import PATHS, SHARD, WHOLE, Verdict, choose
from parts.partition.whole.probe import UNMOVED, family
from parts.partition.whole.replicated import ReplicatedStepper
from parts.partition.whole.stepper import WholeStepper

logger = logging.getLogger("parts.partition")

_STEPPERS = {WHOLE: WholeStepper, "replicated": ReplicatedStepper}


@dataclass
class Settled:
    """What ``route`` settled for one optimizer."""

    path: str
    stepper: Optional[FullStepper] = None  # the outermost optimizer's, on the whole and replicated paths
    infos: list[GroupInfo] = field(default_factory=list)  # the groups a closure's loss is averaged over
    inner: bool = False  # an optimizer a routed wrapper holds: the wrapper's step runs the exchanges


_routed = WeakIdKeyDictionary()
"""Optimizer -> ``Settled``; forgets dead optimizers."""


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


def _masters_message(optimizer: torch.optim.Optimizer, record: Any, path: str) -> str:
    return (f"parts.partition: {type(optimizer).__name__} takes the {path} path, but it steps a copy of "
            f"{record.describe()} that a wrapper keeps (BF16Optimizer's fp32 masters) flat; keep fp32 "
            f"shards as the masters instead: attach(model, mixed_precision=MixedPrecision()) and "
            f"{type(optimizer).__name__}(shards(model)), bf16 on the wire and in compute")


def _infos(slots: list) -> list[GroupInfo]:
    first = slots[0][2]
    return [first.info] + ([first.replica] if getattr(first, "replica", None) is not None else [])


def _agree(verdict: Verdict, info: GroupInfo) -> Verdict:
    """The strictest of the ranks' probed verdicts (one tiny all-reduce): every rank takes the same path."""
    if not verdict.probed:  # from the lists or named by the user: the same on every rank
        return verdict
    code = torch.tensor([PATHS.index(verdict.path)], dtype=torch.int32, device=comm_device(info))
    path = PATHS[int(all_reduce(code, info, ReduceOp.MAX).item())]
    return verdict if path == verdict.path else Verdict(path, "another rank's probe found it", True)


def _log(optimizer: torch.optim.Optimizer, verdict: Verdict, stepper: Optional[FullStepper]) -> None:
    if verdict.why == "listed element-wise":
        return
    costs = stepper.costs() if stepper is not None else "each rank steps its shards, nothing beyond the reduce-scatter"
    logger.info("parts.partition: %s takes the %s path (%s); %s", type(optimizer).__name__, verdict.path,
                verdict.why, costs)


def route(optimizer: torch.optim.Optimizer, path: Optional[str] = None) -> str:
    """Settle (once) and return the path ``optimizer`` takes over its shards: "shard", "whole" or
    "replicated"; ``path`` overrides the choice (before the optimizer first steps)."""
    if isinstance(optimizer, OptimizerWrapper):
        return route(optimizer.optimizer, path)
    settled = _routed.get(optimizer)
    if settled is not None:
        if path is not None and path != settled.path:
            raise RuntimeError(f"parts.partition.route: {type(optimizer).__name__} already takes the {settled.path} "
                               f"path; name the path right after building the optimizer, before it steps")
        return settled.path
    slots = _slots(optimizer)
    if not slots:
        _routed[optimizer] = Settled(SHARD)
        return SHARD
    verdict = _agree(choose(optimizer, path), slots[0][2].info)
    apart = _held_apart(optimizer)
    if apart:
        verdict = _beside(optimizer, apart, verdict)
    if verdict.path != SHARD:
        for _, _, record, own in slots:
            if not own:
                raise RuntimeError(_masters_message(optimizer, record, verdict.path))
    _settle(optimizer, slots, verdict)
    return verdict.path


def _held_apart(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers ``optimizer`` holds as attributes over its tensors in param groups it does not share."""
    mine = {id(t) for g in optimizer.param_groups for t in g["params"]}
    shared = {id(g) for g in optimizer.param_groups}
    members = family(optimizer)
    return [v for v in vars(optimizer).values() if isinstance(v, torch.optim.Optimizer)
            and all(v is not m for m in members)
            and any(id(g) not in shared and any(id(t) in mine for t in g["params"]) for g in v.param_groups)]


def _beside(optimizer: torch.optim.Optimizer, apart: list, verdict: Verdict) -> Verdict:
    """The path of an optimizer whose held optimizers step its parameters in groups of their own: its groups
    stay the shards and each held optimizer takes its own path, where its own update leaves its groups as
    they are (or is element-wise); else refused."""
    names, outer = ", ".join(type(o).__name__ for o in apart), type(optimizer).__name__
    if verdict.why != UNMOVED and verdict.path != SHARD:
        raise RuntimeError(f"parts.partition: {outer} holds {names} over its parameters in param groups of their "
                           f"own, and its own update needs the {verdict.path} path, which rewrites only the groups "
                           f"{outer} holds; build {names} over slices of {outer}'s param groups "
                           f"(self.inner.param_groups = self.param_groups[i:j]) so that one path covers both")
    for inner in apart:
        route(inner)
    return Verdict(SHARD, f"its step steps the {names} it holds over its parameters in groups of their own, "
                          f"each on its own path")


def _settle(optimizer: torch.optim.Optimizer, slots: list, verdict: Verdict) -> None:
    """Rewrite the param groups for ``verdict``'s path; record it for the optimizer and those it holds."""
    members = family(optimizer)
    stepper = _STEPPERS[verdict.path](optimizer, [r for _, _, r, _ in slots]) if verdict.path in _STEPPERS else None
    for g, i, record, own in slots:
        params = optimizer.param_groups[g]["params"]
        old = params[i]
        new = stepper.by_record[id(record)] if stepper is not None else (record.shard if own else old)
        params[i] = new
        keep = stepper is None or stepper.path != WHOLE or stepper.owns(record)
        carry(members, old, new, record, verdict.path, keep)
    if stepper is not None:
        stepper.adopt(members)
    infos = _infos(slots)
    _routed[optimizer] = Settled(verdict.path, stepper, infos)
    for inner in members[1:]:
        _routed[inner] = Settled(verdict.path, None, infos, inner=True)
    _log(optimizer, verdict, stepper)


def stepper_of(optimizer: torch.optim.Optimizer) -> Optional[FullStepper]:
    """The stepper of a routed optimizer on the whole or replicated path, else None."""
    settled = _routed.get(optimizer)
    return settled.stepper if settled is not None else None


class _Router:
    """What the step hooks of core/steps.py call for every optimizer."""

    def resolve(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, OptimizerWrapper) and optimizer not in _routed:
            route(optimizer)

    def before(self, optimizer: torch.optim.Optimizer) -> None:
        settled = _routed.get(optimizer)
        if settled is not None and settled.inner and settled.path != SHARD and not steps.nested_step():
            raise RuntimeError(f"parts.partition: {type(optimizer).__name__} is held by an optimizer that takes the "
                               f"{settled.path} path and brings it its full grads; step that optimizer, not the "
                               f"{type(optimizer).__name__} it holds")
        if settled is not None and settled.stepper is not None:
            settled.stepper.before()

    def after(self, optimizer: torch.optim.Optimizer) -> None:
        stepper = stepper_of(optimizer)
        if stepper is not None:
            stepper.after()

    def held(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        stepper = stepper_of(optimizer)
        return [m.shard for m in stepper.records] if stepper is not None else []

    def wrap(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        settled = _routed.get(optimizer)
        if settled is None or settled.inner or not settled.infos:
            return None
        return closures.wrap(optimizer, args, kwargs, settled.stepper, settled.infos)


def _settle_wrapped(optimizer: torch.optim.Optimizer, wrapper: torch.optim.Optimizer) -> None:
    """Settle the path of an optimizer a wrapper is about to read; refuse the full-tensor paths there."""
    path = route(optimizer)
    if path != SHARD:
        name, outer = type(optimizer).__name__, type(wrapper).__name__
        raise RuntimeError(f"parts.partition: {outer} wraps {name}, which takes the {path} path (its parameters are "
                           f"stepped as full tensors, with state in memory); {outer} steps flat copies or "
                           f"chunks and would give another result. Step {name}(shards(model)) unwrapped: fp32 "
                           f"shards are the masters, attach(model, mixed_precision=MixedPrecision()) gives bf16 "
                           f"compute, and parts.partition.clip_grad_norm_(model, ...) clips before the step")


steps.set_router(_Router())
on_wrap(_settle_wrapped)
