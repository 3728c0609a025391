"""The prefetcher of the coordinator: the trace of each phase and gathers ahead along it.

The first step of a phase records the order its submodules run in (``TraceBook``); later
steps that follow a recorded trace get a ``StepPlan`` (plan.py) and gather the parameters of
the next modules ahead, within ``prefetch_bucket_size`` and the live budget, async with
``overlap_comm``. It also classifies each fetch (on demand, prefetch hit, resident hit).
"""

from __future__ import annotations

from typing import Sequence

from parts.partition.core import disk
from parts.partition.coordinator.debug import StepCheck
from parts.partition.coordinator.live import LiveSet
from parts.partition.coordinator.plan import (Knobs, StepPlan, build_plan, next_use, prefetch_chunks,
                                              prefetch_targets)
from parts.partition.coordinator.stats import StepCounters
from parts.partition.coordinator.step import StepState
from parts.partition.coordinator.table import ParamTable
from parts.partition.coordinator.trace import Trace, TraceBook

_MIN_CHUNK = 1 << 16  # prefetch gathers smaller than this (elements) merge with the next one


class Prefetcher:
    """Trace book, current plan and prefetch gathers of one coordinator."""

    def __init__(self, table: ParamTable, live: LiveSet, knobs: Knobs, check: StepCheck,
                 counters: StepCounters) -> None:
        self.table, self.live, self.knobs, self.check, self.counters = table, live, knobs, check, counters
        self.book = TraceBook()
        self.prefetched: set[int] = set()  # issued by prefetch, not yet used by a fetch
        self._plans: dict[tuple, StepPlan] = {}

    def observe(self, step: StepState, kind: str, index: int) -> None:
        """Record the event in the trace; if the step follows a stored trace, plan along it."""
        obs = self.book.observe(step.phase, (kind, index))
        step.position = obs.position
        if obs.trace is not None:
            self._use_plan(step, obs.trace)

    def _use_plan(self, step: StepState, trace: Trace) -> None:
        key = (id(trace), self.table.version)
        if step.plan_key == key:
            return
        plan = self._plans.get(key)
        if plan is None:
            sets = [self.table.sets[index] for _, index in trace.events]
            plan = build_plan(sets, self.table.sizes, self.table.persistent)
            self._plans = {key: plan}
        step.plan, step.plan_key, step.events = plan, key, trace.events
        step.horizon, step.recheck = None, set()

    def count_fetch(self, ids: Sequence[int]) -> None:
        """Count a module fetch of non-persistent params: on demand, prefetch hit or resident hit."""
        ids = [pid for pid in ids if pid not in self.table.persistent]
        if not ids:
            return
        c = self.counters
        c.fetches += 1
        if any(not self.live.resident(pid) for pid in ids):
            c.on_demand_fetches += 1
        elif any(pid in self.prefetched for pid in ids):
            c.prefetch_hits += 1
        else:
            c.resident_hits += 1
        self.prefetched.difference_update(ids)

    def prefetch(self, step: StepState) -> None:
        """Gather ahead along the plan (chunks by next use) from the step's horizon on."""
        if step.position is None or step.plan is None:
            return
        if self.table.any_parked:  # shards on disk: their reads run ahead of the gathers (disk.py)
            disk.read_ahead(self.table.records, step.plan, step.position,
                            disk.READ_AHEAD_FACTOR * self.knobs.prefetch_bucket_size, self.live.resident,
                            max_reuse_distance=self.knobs.max_reuse_distance)
        if step.horizon == len(step.plan) and not step.recheck:
            return  # the whole rest of the trace is covered already
        again = self._recheck(step)
        extra = sum(self.table.sizes[pid] for pid in again)
        ids, step.horizon = prefetch_targets(
            step.plan, step.position, self.knobs.prefetch_bucket_size, self.live.total + extra,
            self.knobs.max_live_parameters, self.live.resident, start=step.horizon)
        ids = tuple(dict.fromkeys(again + list(ids)))
        if not ids:
            return
        self.counters.prefetched_params += len(ids)
        self.prefetched.update(ids)
        positions = [next_use(step.plan, pid, step.position) for pid in ids]
        for chunk in prefetch_chunks(ids, positions, self.table.sizes, _MIN_CHUNK):
            uses = [step.events[next_use(step.plan, pid, step.position)] for pid in chunk]
            kinds = [kind for kind, _ in uses]
            self.check.point(step, "prefetch", uses[0][1], chunk)
            self.live.gather(list(chunk), self.knobs.overlap_comm, kinds)

    def _recheck(self, step: StepState) -> list[int]:
        """Released params needed again before the horizon (already walked past): gather again."""
        again, budget = [], self.knobs.max_live_parameters - self.live.total
        for pid in sorted(step.recheck):
            later = next_use(step.plan, pid, step.position)
            if later is None or step.horizon is None or later >= step.horizon or self.live.resident(pid):
                step.recheck.discard(pid)
            elif self.table.sizes[pid] <= budget:
                budget -= self.table.sizes[pid]
                again.append(pid)
                step.recheck.discard(pid)
        return again
