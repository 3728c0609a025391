"""The steps of the coordinator: one in progress per phase, how a step begins and ends.

A step begins at the first forward (or backward) of its phase: the trace book starts
recording, rank 0's buffers are broadcast (``sync_buffers``) and the persistent parameters
that need it are gathered in one collective (those of the flat buffer, flat.py, in one of
their own). It ends when its forward returns (no grad) or its backward does: the trace is
stored, idle parameters are released and the counters of the step are frozen into the
``CoordinatorStats`` that ``stats()`` returns.

Between steps, what stays gathered is current: after every optimizer step (core/steps.py
calls ``after_optimizer_step`` when the outermost ``step()`` returns) the persistent
parameters whose shards changed are gathered again, synchronously, so ``state_dict()``,
``named_parameters()`` and any user read see the stepped values; the next step's start then
finds them current (the same collective, moved). An optimizer step inside a backward
(``OffloadedOptimizer.step_in_backward``) leaves them to the ``step()`` that must follow it.
Reads of shards changed any other way: reads.py.

Only a step of this model's own shards refreshes it: the hook tells every coordinator of the
process after any optimizer's step, and one whose persistent shards no step counted since
(``record.steps``, core/steps.py) issues nothing. Another model's optimizer steps so never
make this one gather; in particular a model dropped without ``detach``, whose coordinator
lives until a garbage collection that comes at different moments on different ranks, never
issues a collective that only the ranks still holding it would join.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from parts._compat import in_backward
from parts.partition.core import steps as optimizer_steps
from parts.partition.coordinator.debug import StepCheck
from parts.partition.coordinator.flat import CURRENT, FALLBACK, INSTALL, REFILL, FlatGather
from parts.partition.coordinator.live import LiveSet
from parts.partition.coordinator.prefetch import Prefetcher
from parts.partition.coordinator.reads import ReadGuard
from parts.partition.core.compression import residual_bytes
from parts.partition.coordinator.stats import CoordinatorStats, StepCounters, freeze
from parts.partition.coordinator.step import StepState
from parts.partition.coordinator.table import ParamTable
from parts.partition.coordinator.trace import trace_digest
from parts.partition.interop.buffers import broadcast_buffers


class Steps:
    """The step in progress of each phase (``current``), steps begun per phase, the last stats."""

    def __init__(self, root: nn.Module, table: ParamTable, live: LiveSet, prefetcher: Prefetcher,
                 check: StepCheck, counters: StepCounters, sync_buffers: bool, flat: FlatGather) -> None:
        self.root, self.table, self.live, self.prefetcher, self.flat = root, table, live, prefetcher, flat
        self.check, self.counters, self.sync_buffers = check, counters, sync_buffers
        self.current: dict[str, StepState] = {}
        self.begun: dict[str, int] = {}  # steps begun per phase (debug mode names them)
        self.last: Optional[CoordinatorStats] = None
        self._misses = 0
        self._done = 0
        self._buffers_dirty = True
        self._own = [table.records[pid] for pid in table.persistent_ids]
        self._counted = self._own_steps()  # steps counted on them when this coordinator last looked
        self.reads = ReadGuard(root, table)
        optimizer_steps.listen(self.after_optimizer_step)

    def close(self) -> None:
        """Detach: no more refreshes after optimizer steps, no read guard."""
        optimizer_steps.unlisten(self.after_optimizer_step)
        self.reads.remove()

    def get(self, phase: Optional[str]) -> Optional[StepState]:
        """The step in progress of ``phase`` (None if none)."""
        return self.current.get(phase) if phase is not None else None

    def active(self, phase: str) -> bool:
        """True if a step of ``phase`` is recording its trace."""
        return self.prefetcher.book.active(phase)

    def begin(self, phase: str) -> None:
        """Start a step of ``phase``: trace, buffers, persistent parameters."""
        self.prefetcher.book.begin(phase)
        number = self.begun.get(phase, 0)
        self.begun[phase] = number + 1
        self.current[phase] = StepState(phase, number=number)
        self._sync_buffers(phase)
        self._refresh_persistent(phase)

    def _sync_buffers(self, phase: str) -> None:
        """Rank 0's buffers to every rank at a train-mode step and the first step after one."""
        if self.sync_buffers and self.table.records and (self._buffers_dirty or phase.startswith("train")):
            broadcast_buffers(self.root, next(iter(self.table.records.values())).info)
            self._buffers_dirty = phase.startswith("train")  # train mode updates buffers

    def _refresh_persistent(self, phase: str) -> None:
        """Gather the persistent params that need it in one (async) collective at a step's start:
        those not gathered, and, in place, those whose shard an optimizer stepped since; the flat
        ones (flat.py) in a collective of their own. The decision is local (every rank steps its
        shards of the same params); ``debug`` checks it."""
        how = self.flat.decide(self.live.uses)
        flat = how in (REFILL, INSTALL)
        todo, stale = self.live.persistent_to_gather(
            self.table.persistent_ids if how == FALLBACK else self.flat.others)
        ids = todo + stale + (self.flat.pids if flat else [])
        self.check.point(self.current[phase], "start", ids=sorted(ids))
        if flat:
            self.live.refresh_flat(self.flat, how)
        self.live.refresh_persistent(todo, stale, self.live.knobs.overlap_comm)

    def after_optimizer_step(self) -> None:
        """An optimizer step ended: if it (or one in the backward before it) stepped a persistent
        shard of this model, gather again (synchronously) the persistent params whose shards
        changed, so reads between steps see them. Not in a backward (a step there is left to the
        ``step()`` after it); params a running forward holds are skipped (``refresh``)."""
        if in_backward():
            return
        counted = self._own_steps()
        if counted != self._counted:
            self._counted = counted
            self.refresh()

    def _own_steps(self) -> int:
        """Optimizer steps counted so far on this model's persistent shards (only ever grows)."""
        return sum(m.steps for m in self._own)

    def refresh(self) -> None:
        """Gather again the gathered persistent params whose shards changed and nothing holds (one
        collective per kind, none if nothing changed); those not gathered wait for the next
        step's start."""
        how = self.flat.decide(self.live.uses)  # not REFILL: the flat ones one by one (if gathered)
        _, stale = self.live.persistent_to_gather(
            self.flat.others if how in (CURRENT, REFILL) else self.table.persistent_ids)
        if how != REFILL and not stale:
            return
        self.outside("refresh after an optimizer step")
        if how == REFILL:
            self.live.refresh_flat(self.flat, how)
        self.live.refresh_persistent([], stale, False)

    def end(self, phase: str) -> None:
        """Finish the step of ``phase``: store its trace, release idle params, freeze the counters."""
        step = self.current.pop(phase)
        record = self.prefetcher.book.end(phase)
        digest = trace_digest(record.events, self.table.names)
        self.check.point(step, "end", digest=int(digest, 16))
        self.live.end_step()
        self.prefetcher.prefetched.clear()
        self._misses += record.outcome == "diverged"
        self._done += 1
        pool = self.live.pool
        self.last = freeze(self.counters, steps=self._done, phase=phase,
                           trace_outcome=record.outcome, trace_events=len(record.events),
                           trace_digest=digest, trace_misses=self._misses,
                           persistent_params=len(self.table.persistent),
                           persistent_elements=self.table.persistent_elements(),
                           cached_bytes=pool.cached_bytes if pool else 0,
                           residual_bytes=residual_bytes(self.table.records.values()))
        self.counters.reset()

    def abandon(self, phase: str) -> None:
        """Forget the step of ``phase`` after an error; release what it held, locally only."""
        self.current.pop(phase, None)
        self.prefetcher.book.abandon(phase)
        self.prefetcher.prefetched.clear()
        self.live.release(self.live.idle())
        self.counters.reset()

    def outside(self, what: str) -> None:
        """Debug mode: agree with every rank on a collective outside a step, and on steps begun."""
        self.check.outside(what, sum(self.begun.values()), self.begun.get("train", 0))
