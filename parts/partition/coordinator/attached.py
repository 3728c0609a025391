"""The state of an attached ``FetchCoordinator``, built whole by ``attach`` and dropped whole by
``detach``: its pieces (each holding its own state) and the hooks' lifecycle. The coordinator
reads and writes it through ``Through`` attributes, so while detached it holds none of it."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from parts.comm import GroupArg, GroupInfo, group_info
from parts.partition.coordinator.abort import BackwardWatch
from parts.partition.coordinator.debug import StepCheck
from parts.partition.coordinator.flat import FlatGather, FlatReduce
from parts.partition.coordinator.frozen import FrozenRelease
from parts.partition.coordinator.hooks import ModuleHooks, RunningUnits
from parts.partition.coordinator.live import LiveSet
from parts.partition.coordinator.plan import Knobs
from parts.partition.coordinator.prefetch import Prefetcher
from parts.partition.coordinator.reduce import GradReducer
from parts.partition.coordinator.secondary import SecondaryShards
from parts.partition.coordinator.stats import StepCounters
from parts.partition.coordinator.step import ModuleCall
from parts.partition.coordinator.steps import Steps
from parts.partition.coordinator.table import ParamTable
from parts.partition.coordinator.trainable import TrainableCheck
from parts.partition.coordinator.uneven import UnevenRanks
from parts.partition.core.precision import MixedPrecision


class Attached:
    """What an attached coordinator holds: its named pieces (each holding its own state) and the
    hooks' lifecycle. Built whole by ``attach``, dropped whole by ``detach``."""

    def __init__(self, module: nn.Module, knobs: Knobs, group: GroupArg,
                 precision: Optional[MixedPrecision], sync_buffers: bool,
                 undo_precision: Optional[Callable[[], None]], backward_step: Callable,
                 drop_aborted: Callable[[], None], secondary_group: GroupArg = None,
                 scopes: Sequence[GroupInfo] = (), conditional: frozenset = frozenset()) -> None:
        self.root = module
        self._undo_precision = undo_precision
        self.counters = StepCounters()
        self.table = ParamTable(module, knobs, conditional)
        self.check = StepCheck(knobs.debug, self.table.names, self.table.group(group),
                               self.table.param_names)
        self.live = LiveSet(self.table, knobs, group, self.counters)
        if secondary_group is not None:  # node-local backward gathers
            self.live.secondary = SecondaryShards.build(list(self.table.records.values()), secondary_group,
                                                        self.counters)
        self.prefetcher = Prefetcher(self.table, self.live, knobs, self.check, self.counters)
        reduce_dtype = precision.reduce_dtype if precision else torch.float32
        self.flat = FlatGather(self.table)
        self.flat_grads = FlatReduce(self.flat, reduce_dtype)
        self.reducer = GradReducer(self.table, knobs, group, self.check, self.counters, reduce_dtype,
                                   self.flat_grads)
        self.steps = Steps(module, self.table, self.live, self.prefetcher, self.check, self.counters,
                           sync_buffers, self.flat)
        self.flat_ids = frozenset(self.flat.pids)
        self.uneven = UnevenRanks(self.table, group)
        self.live.log = self.reducer.log = self.uneven.log  # their collectives, agreed at a backward's end
        names = [self.table.param_names.get(pid, f"#{pid}") for pid in self.table.params]
        self.trainable = TrainableCheck(list(self.table.params.values()), names, scopes,
                                        group_info(self.table.group(group)))
        self.frozen = FrozenRelease(self.table, self.live, backward_step)
        self.watch = BackwardWatch(self.table, self.live, self.reducer, self.steps, drop_aborted)
        self._checker: Optional[weakref.WeakMethod] = None  # debug: the step check's hook (points.py)
        self._hooks: dict[int, ModuleHooks] = {}
        self._grad_hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._unhooked = list(self.table.params.values())  # params without a grad hook (yet)
        self._stack: list[ModuleCall] = []
        self._bwd_phase: Optional[str] = None
        self._bwd_creates_graph = False
        self._units: dict[int, int] = {}  # submodule index -> its fused block's (compiled.py)
        self._running = RunningUnits()  # which unit's own parameter reads are not external


class Through:
    """A coordinator attribute that lives on its ``Attached`` state: there only while attached."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        if obj is None:
            return self
        if obj._state is None:
            raise AttributeError(f"FetchCoordinator.{self.name}: the coordinator is not attached")
        return getattr(obj._state, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj._state, self.name, value)
