"""Fetch engine of the coordinator: gather, prefetch, reuse, budget and release decisions.

``FetchEngine`` is the half of ``FetchCoordinator`` that acts on parameters; the hooks and
the step lifecycle live in coordinator.py. Every decision comes from the pure functions
of plan.py; this class keeps the live set, use counts and counters, and calls the core's
``gather``/``release``. Use counts: a parameter is released only when no running forward,
no pending backward and no reuse decision holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from parts.partition.core import disk
from parts.partition.coordinator.debug import DebugPoint, check_point, ids_digest
from parts.partition.core.gather import gather, release
from parts.partition.core.param import ParamStatus
from parts.partition.coordinator.plan import (StepPlan, build_plan, choose_evictions, collective_bytes,
                                  keep_after_use, next_use, prefetch_chunks, prefetch_targets)
from parts.partition.coordinator.hooks import in_backward
from parts.partition.coordinator.trace import BACKWARD, FORWARD

__all__ = ["FetchEngine", "ModuleCall", "StepState"]

_NOT_AVAILABLE = ParamStatus.NOT_AVAILABLE
_AVAILABLE = ParamStatus.AVAILABLE
_MIN_CHUNK = 1 << 16  # prefetch gathers smaller than this (elements) merge with the next one


@dataclass
class ModuleCall:
    """One running forward (or backward) of a hooked module and the params it holds."""

    index: int
    phase: str
    ids: list  # stable ids of the parameters it holds


@dataclass
class StepState:
    """The step in progress of one phase."""

    phase: str
    position: Optional[int] = None
    plan: Optional[StepPlan] = None
    plan_key: Any = None
    events: tuple = ()
    horizon: Optional[int] = None  # first trace position whose params prefetch has not covered
    recheck: set = field(default_factory=set)  # released ids needed again before the horizon
    seq: int = 0  # debug mode: number of the next checked event of the step
    pending_backward: bool = False
    number: int = 0  # this step's index among the steps of its phase (0, 1, ...)


class FetchEngine:
    """Parameter-side state and decisions of a ``FetchCoordinator`` (see coordinator.py)."""

    _recs: dict  # stable id -> ParamMeta (cached: meta() would be on every hot path)

    def _fetch(self, call: ModuleCall, kind: str) -> None:
        step = self._steps[call.phase]
        obs = self._book.observe(call.phase, (kind, call.index))
        step.position = obs.position
        if obs.trace is not None:
            self._use_plan(step, obs.trace)
        self._check(step, kind, call.index)
        own = set(call.ids)
        self._make_room(own, step)
        self._count_fetch(call.ids)
        self._gather(call.ids, async_op=False, kind=kind)
        for pid in own:
            self._uses[pid] = self._uses.get(pid, 0) + 1
        if step.position is not None and step.plan is not None:
            self._prefetch(step)

    def _check(self, step: Optional[StepState], kind: str, module: int = -1, ids: Iterable[int] = (),
               digest: Optional[int] = None) -> None:
        """Debug mode: agree with every rank on (phase, step, event, kind, module, ids) first."""
        if not self.knobs.debug:
            return
        ids = list(ids)
        if step is None:  # no step in progress (cannot happen when the ranks agree)
            step = StepState("?", number=-1, seq=-1)
        point = DebugPoint(step.phase, step.number, step.seq, kind, module, len(ids),
                           ids_digest(ids) if digest is None else digest)
        step.seq += 1
        check_point(point, self._names, self._group())

    def _use_plan(self, step: StepState, trace: Any) -> None:
        key = (id(trace), self._sets_version)
        if step.plan_key == key:
            return
        plan = self._plans.get(key)
        if plan is None:
            sets = [self._sets[index] for _, index in trace.events]
            plan = build_plan(sets, self._sizes, self._persistent)
            self._plans = {key: plan}
        step.plan, step.plan_key, step.events = plan, key, trace.events
        step.horizon, step.recheck = None, set()

    def _count_fetch(self, ids: list) -> None:
        ids = [pid for pid in ids if pid not in self._persistent]
        if not ids:
            return
        c = self._counters
        c.fetches += 1
        if any(self._recs[pid].status is _NOT_AVAILABLE for pid in ids):
            c.on_demand_fetches += 1
        elif any(pid in self._prefetched for pid in ids):
            c.prefetch_hits += 1
        else:
            c.resident_hits += 1
        self._prefetched.difference_update(ids)

    def _gather(self, ids: list, async_op: bool, kind: Any = FORWARD) -> None:
        """Gather the params (by id) not yet available in one collective (sync joins in-flight
        ones); ``kind`` (one per param, or one for all) names the pass the gather serves."""
        recs = self._recs
        todo = [pid for pid in ids if recs[pid].status is not _AVAILABLE]
        if not todo:
            return
        kinds = dict(zip(ids, kind)) if isinstance(kind, list) else {}
        fresh = [pid for pid in todo if recs[pid].status is _NOT_AVAILABLE]
        for pid in fresh:
            self._note_gathered(pid, self._pass_key(kinds.get(pid, kind)))
        if fresh:
            self._counters.allgather_calls += 1
        gather([self._by_id[pid] for pid in todo], self.group, async_op=async_op, pool=self._pool)

    def _pass_key(self, kind: str) -> tuple:
        """The pass a gather serves: this backward, this forward, or the next backward."""
        if in_backward():
            return BACKWARD, self._bwd_no
        return (FORWARD, self._fwd_no) if kind == FORWARD else (BACKWARD, self._bwd_no + 1)

    def _note_gathered(self, pid: int, pass_key: tuple) -> None:
        m = self._recs[pid]
        self._counters.gathered(pid, collective_bytes(m.layout.shard_numel, m.world_size,
                                                      m.dtype.itemsize))
        seen = self._pass_gathers.get((pass_key, pid), 0)
        self._pass_gathers[(pass_key, pid)] = seen + 1
        self._counters.regathered_params += seen > 0
        if pid not in self._persistent and pid not in self._live:
            self._live[pid] = m.numel
            self._live_total += m.numel
            self._counters.live_high_water = max(self._counters.live_high_water, self._live_total)

    def _prefetch(self, step: StepState) -> None:
        if self._any_parked:  # shards on disk: their reads run ahead of the gathers (disk.py)
            disk.read_ahead(self._recs, step.plan, step.position,
                            disk.READ_AHEAD_FACTOR * self.knobs.prefetch_bucket_size,
                            lambda pid: self._recs[pid].status is not _NOT_AVAILABLE)
        if step.horizon == len(step.plan) and not step.recheck:
            return  # the whole rest of the trace is covered already

        def resident(pid: int) -> bool:
            return self._recs[pid].status is not _NOT_AVAILABLE

        again = self._recheck(step, resident)
        extra = sum(self._sizes[pid] for pid in again)
        ids, step.horizon = prefetch_targets(
            step.plan, step.position, self.knobs.prefetch_bucket_size, self._live_total + extra,
            self.knobs.max_live_parameters, resident, start=step.horizon)
        ids = tuple(dict.fromkeys(again + list(ids)))
        if not ids:
            return
        self._counters.prefetched_params += len(ids)
        self._prefetched.update(ids)
        positions = [next_use(step.plan, pid, step.position) for pid in ids]
        for chunk in prefetch_chunks(ids, positions, self._sizes, _MIN_CHUNK):
            uses = [step.events[next_use(step.plan, pid, step.position)] for pid in chunk]
            kinds = [kind for kind, _ in uses]
            self._check(step, "prefetch", uses[0][1], chunk)
            self._gather(list(chunk), self.knobs.overlap_comm, kinds)

    def _recheck(self, step: StepState, resident: Any) -> list:
        """Released params needed again before the horizon (already walked past): gather again."""
        again, budget = [], self.knobs.max_live_parameters - self._live_total
        for pid in sorted(step.recheck):
            later = next_use(step.plan, pid, step.position)
            if later is None or step.horizon is None or later >= step.horizon or resident(pid):
                step.recheck.discard(pid)
            elif self._sizes[pid] <= budget:
                budget -= self._sizes[pid]
                again.append(pid)
                step.recheck.discard(pid)
        return again

    def _make_room(self, own: set, step: Optional[StepState]) -> None:
        """Release idle gathered params (farthest next use first) until the others fit the budget."""
        others = self._live_total - sum(self._live.get(pid, 0) for pid in own)
        excess = others - self.knobs.max_live_parameters
        if excess <= 0:
            return
        idle = [(pid, size, self._next_use(step, pid)) for pid, size in self._live.items()
                if pid not in own and not self._uses.get(pid)]
        victims = choose_evictions(idle, excess)
        self._counters.evicted_params += len(victims)
        self._release_ids(victims, step)

    def _next_use(self, step: Optional[StepState], pid: int) -> Optional[int]:
        if step is None or step.plan is None or step.position is None:
            return None
        return next_use(step.plan, pid, step.position)

    def _done_with(self, ids: list, step: Optional[StepState]) -> None:
        ids = list(dict.fromkeys(ids))
        for pid in ids:
            self._uses[pid] = self._uses.get(pid, 0) - 1
        self._settle(ids, step)

    def _settle(self, ids: Iterable[int], step: Optional[StepState]) -> None:
        """Release the idle ones among ``ids``, except those the plan keeps for reuse."""
        idle = [pid for pid in ids if pid in self._live and not self._uses.get(pid)]
        if not idle:
            return
        keep: frozenset = frozenset()
        if step is not None and step.plan is not None and step.position is not None:
            keep = keep_after_use(step.plan, step.position, idle, self._live_total,
                                  self.knobs.max_live_parameters, self.knobs.max_reuse_distance)
        self._release_ids([pid for pid in idle if pid not in keep], step)

    def _release_ids(self, ids: Iterable[int], step: Optional[StepState] = None) -> None:
        params = []
        for pid in ids:
            size = self._live.pop(pid, None)
            if size is not None:
                self._live_total -= size
                params.append(self._by_id[pid])
                if step is not None and step.horizon is not None:
                    step.recheck.add(pid)
        if params:
            release(params, free_storage=True, pool=self._pool)
