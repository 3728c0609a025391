"""The live set of the coordinator: which parameters are gathered, who holds them, the budget.

A parameter is released only when no running forward, no pending backward and no reuse
decision holds it (its use count is zero). Non-persistent gathered (or in-flight) elements
count against ``max_live_parameters``; a fetch first releases idle parameters, farthest next
use first. Released full-parameter memory goes to the storage pool for the next gathers.
Every decision comes from the pure functions of plan.py; the gathers and releases are the
core's ``gather``/``release``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional, Sequence, Union

from parts.base.storage_pool import StoragePool
from parts.comm import GroupArg, WeakGroup
from parts._compat import in_backward
from parts.partition.coordinator.plan import Knobs, choose_evictions, collective_bytes, keep_after_use
from parts.partition.coordinator.stats import StepCounters
from parts.partition.coordinator.step import StepState
from parts.partition.coordinator.table import ParamTable
from parts.partition.coordinator.trace import BACKWARD, FORWARD
from parts.partition.coordinator.uneven import GATHER, CollectiveLog
from parts.partition.core.compression import gather_wire_bytes
from parts.partition.core.gather import gather, release
from parts.partition.core.param import ParamStatus, is_stale, wanted_dtype

if TYPE_CHECKING:
    from parts.partition.coordinator.flat import FlatGather
    from parts.partition.coordinator.secondary import SecondaryShards

_NOT_AVAILABLE = ParamStatus.NOT_AVAILABLE
_AVAILABLE = ParamStatus.AVAILABLE


class LiveSet:
    """Gathered parameters, their use counts and the live-elements budget of one coordinator.

    ``uses[pid]``: running forwards and backwards (and reuse) holding ``pid``; ``live``:
    non-persistent gathered ids and their sizes, ``total`` their sum; ``pool``: freed storage
    kept for the next gathers (None with ``cache_freed_storage=False``).
    """

    group = WeakGroup()  # not kept alive past destroy_process_group (see WeakGroup)

    def __init__(self, table: ParamTable, knobs: Knobs, group: GroupArg, counters: StepCounters) -> None:
        self.table, self.knobs, self.group, self.counters = table, knobs, group, counters
        self.uses: dict[int, int] = {}
        self.backward_uses: dict[int, int] = {}  # uses by backward passes in progress
        self.graph_holds: set[int] = set()  # used by a create_graph backward: its graph needs them
        self.live: dict[int, int] = {}
        self.total = 0
        self.pool: Optional[StoragePool] = StoragePool() if knobs.cache_freed_storage else None
        self.forwards = self.backwards = 0  # passes begun (a gather is counted against one)
        self._pass_gathers: dict[tuple, int] = {}
        self.secondary: Optional["SecondaryShards"] = None  # node-local backward gathers (secondary.py)
        self.log: Optional[CollectiveLog] = None  # the gathers, agreed at a backward's end (uneven.py)

    # ---------------------------------------------------------------------- gathers
    def resident(self, pid: int) -> bool:
        """Gathered or in flight."""
        return self.table.records[pid].status is not _NOT_AVAILABLE

    def gather(self, ids: Sequence[int], async_op: bool, kind: Union[str, list] = FORWARD) -> None:
        """Gather the params (by id) not yet available in one collective (sync joins in-flight
        ones); ``kind`` (one per param, or one for all) names the pass the gather serves."""
        recs = self.table.records
        todo = [pid for pid in ids if recs[pid].status is not _AVAILABLE]
        if not todo:
            return
        kinds = dict(zip(ids, kind)) if isinstance(kind, list) else {}
        if self.log is not None:
            self.log.note(GATHER, todo)
        fresh = [pid for pid in todo if recs[pid].status is _NOT_AVAILABLE]
        near = self._from_secondary(fresh)
        wire = self._wire_bytes([pid for pid in fresh if pid not in near])
        for pid in fresh:
            self._note_gathered(pid, self._pass_key(kinds.get(pid, kind)), pid in near, wire.get(pid))
        self.counters.allgather_calls += bool(near) + bool(len(fresh) > len(near))
        if near:  # over the node group; the others (and joins of in-flight ones) over the shard group
            self.secondary.gather(near, self.table.select(near), async_op, self.pool)
            todo = [pid for pid in todo if pid not in near]
        if todo:
            gather(self.table.select(todo), self.group, async_op=async_op, pool=self.pool, compute=True)

    def _from_secondary(self, fresh: list[int]) -> list[int]:
        """The ids among ``fresh`` to gather from their secondary shards, sorted (the same on every rank)."""
        store = self.secondary
        if store is None or not store.kept or not fresh:
            return []
        return sorted(pid for pid in fresh if store.usable(pid, self.table.records[pid]))

    def _pass_key(self, kind: str) -> tuple:
        """The pass a gather serves: this backward, this forward, or the next backward."""
        if in_backward():
            return BACKWARD, self.backwards
        return (FORWARD, self.forwards) if kind == FORWARD else (BACKWARD, self.backwards + 1)

    def _wire_bytes(self, ids: list[int]) -> dict[int, int]:
        """Each of ``ids``' bytes in one gather of them that travels as codes (core/compression.py), else {}."""
        records = [self.table.records[pid] for pid in ids]
        shares = gather_wire_bytes(records, records[0].info) if records else None
        return dict(zip(ids, shares)) if shares is not None else {}

    def _note_gathered(self, pid: int, pass_key: tuple, near: bool = False, nbytes: Optional[int] = None) -> None:
        m = self.table.records[pid]
        if nbytes is None:
            nbytes = self.secondary.wire_bytes(pid) if near else collective_bytes(
                m.layout.shard_numel, m.world_size, wanted_dtype(m, True).itemsize)
        self.counters.gathered(pid, nbytes)
        self._count_pass(pid, pass_key)
        if pid not in self.table.persistent and pid not in self.live:
            self.live[pid] = m.numel
            self.total += m.numel
            self.counters.live_high_water = max(self.counters.live_high_water, self.total)

    def _count_pass(self, pid: int, pass_key: tuple) -> None:
        """One more gather of ``pid`` in the pass; from the second on it is a regather."""
        seen = self._pass_gathers.get((pass_key, pid), 0)
        self._pass_gathers[(pass_key, pid)] = seen + 1
        self.counters.regathered_params += seen > 0

    # ------------------------------------------------------------------- use counts
    def use(self, ids: Iterable[int]) -> None:
        """A forward (or an external read) holds ``ids``."""
        for pid in ids:
            self.uses[pid] = self.uses.get(pid, 0) + 1

    def use_in_backward(self, ids: Iterable[int]) -> None:
        """A backward holds ``ids`` until their grads are complete (``grad_complete``)."""
        for pid in ids:
            self.backward_uses[pid] = self.backward_uses.get(pid, 0) + 1

    def grad_complete(self, pid: int, step: Optional[StepState]) -> None:
        """``pid``'s last backward use is over: drop the backward's holds, release it if idle."""
        held = self.backward_uses.pop(pid, 0)
        if self.secondary is not None:
            self.secondary.drop([pid])
        if held:
            self.uses[pid] -= held
            self.settle([pid], step)

    def backward_done(self, ids: Iterable[int], step: Optional[StepState]) -> None:
        """One backward use of ``ids`` (frozen: no grad to complete) is over: drop its hold, release if idle."""
        ids = [pid for pid in dict.fromkeys(ids) if self.backward_uses.get(pid)]
        if self.secondary is not None:
            self.secondary.drop(ids)
        for pid in ids:
            self.backward_uses[pid] -= 1
            self.uses[pid] -= 1
        self.settle(ids, step)

    def hold_for_graph(self, ids: Iterable[int]) -> None:
        """A backward with ``create_graph`` used ``ids``: the graph it builds (a gradient
        penalty's) reads them in the next backward, so they stay gathered until that ends."""
        for pid in ids:
            if pid not in self.graph_holds:
                self.graph_holds.add(pid)
                self.uses[pid] = self.uses.get(pid, 0) + 1

    def drop_graph_holds(self) -> None:
        """A backward without ``create_graph`` ended: the held params may go (at the step's end)."""
        for pid in self.graph_holds:
            self.uses[pid] -= 1
        self.graph_holds.clear()

    def end_backward(self) -> None:
        """The backward is over: drop every hold it still had (no release here: the step ends)."""
        for pid, held in self.backward_uses.items():
            self.uses[pid] -= held
        self.backward_uses.clear()
        if self.secondary is not None:
            self.secondary.drop_all()

    def done_with(self, ids: Sequence[int], step: Optional[StepState]) -> None:
        """A forward that held ``ids`` returned: drop its holds, release the idle ones."""
        ids = list(dict.fromkeys(ids))
        for pid in ids:
            self.uses[pid] = self.uses.get(pid, 0) - 1
        self.settle(ids, step)

    def idle(self) -> list[int]:
        """Live ids nobody holds."""
        return [pid for pid in self.live if not self.uses.get(pid)]

    # ---------------------------------------------------------------------- release
    def settle(self, ids: Iterable[int], step: Optional[StepState]) -> None:
        """Release the idle ones among ``ids``, except those the plan keeps for reuse."""
        idle = [pid for pid in ids if pid in self.live and not self.uses.get(pid)]
        if not idle:
            return
        keep: frozenset = frozenset()
        if step is not None and step.plan is not None and step.position is not None:
            keep = keep_after_use(step.plan, step.position, idle, self.total,
                                  self.knobs.max_live_parameters, self.knobs.max_reuse_distance)
        self.release([pid for pid in idle if pid not in keep], step)

    def make_room(self, own: set[int], step: Optional[StepState]) -> None:
        """Release idle gathered params (farthest next use first) until the others fit the budget."""
        others = self.total - sum(self.live.get(pid, 0) for pid in own)
        excess = others - self.knobs.max_live_parameters
        if excess <= 0:
            return
        idle = [(pid, size, step.next_use(pid) if step is not None else None)
                for pid, size in self.live.items() if pid not in own and not self.uses.get(pid)]
        victims = choose_evictions(idle, excess)
        self.counters.evicted_params += len(victims)
        self.release(victims, step)

    def release(self, ids: Iterable[int], step: Optional[StepState] = None) -> None:
        """Release the live ones among ``ids`` (freeing their storage into the pool); a step
        whose prefetch already covered them is told to look at them again."""
        params = []
        for pid in ids:
            size = self.live.pop(pid, None)
            if size is not None:
                self.total -= size
                params.append(self.table.params[pid])
                if step is not None and step.horizon is not None:
                    step.recheck.add(pid)
        if params:
            if self.secondary is not None and _before_backward(step):
                for p in params:  # the next gather of the step comes from the node (secondary.py)
                    self.secondary.keep(self.table.pid(p), p)
            release(params, free_storage=True, pool=self.pool)

    def end_step(self) -> None:
        """Release every idle parameter; the per-pass gather counts start over."""
        self.release(self.idle())
        self._pass_gathers.clear()
        if self.secondary is not None:
            self.secondary.drop_all()

    # ------------------------------------------------------------------- persistent
    def persistent_to_gather(self, ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Persistent ``ids`` not gathered, and those gathered but stale (an optimizer stepped the shard)."""
        todo, stale = [], []
        for pid in ids:
            m = self.table.records[pid]
            if m.status is _NOT_AVAILABLE:
                todo.append(pid)
            elif not self.uses.get(pid) and (is_stale(m) or m.full_dtype != wanted_dtype(m, True)):
                stale.append(pid)
        return todo, stale

    def refresh_persistent(self, todo: list[int], stale: list[int], async_op: bool) -> None:
        """Gather ``todo`` and the ``stale`` persistent params in one collective; the stale
        ones stay gathered and are refilled in place (``core.gather``: no release, no alloc)."""
        ids = sorted(todo + stale)
        if not ids:
            return
        self.counters.persistent_gathers += len(ids)
        self.counters.allgather_calls += 1
        key = self._pass_key(FORWARD)
        wire = self._wire_bytes(ids)
        for pid in ids:
            self._note_gathered(pid, key, nbytes=wire.get(pid))
        gather(self.table.select(ids), self.group, async_op=async_op, pool=self.pool, compute=True)

    def refresh_flat(self, flat: "FlatGather", how: str) -> None:
        """Gather the flat persistent params in one collective (``flat.py``), counted per param."""
        self.counters.persistent_gathers += len(flat.pids)
        self.counters.allgather_calls += 1
        self.counters.gathered_many(flat.pids, flat.nbytes)
        key = self._pass_key(FORWARD)
        for pid in flat.pids:  # persistent: never in the live set
            self._count_pass(pid, key)
        flat.gather(how)

    def release_all(self) -> None:
        """Release every gathered parameter (persistent too) and drop the pool: detach."""
        held = [pid for pid in self.table.params if self.resident(pid)]
        release(self.table.select(held))
        self.pool = None
        if self.secondary is not None:
            self.secondary.close()


def _before_backward(step: Optional[StepState]) -> bool:
    """True in a forward of a step that computes grads (its backward may gather again)."""
    return step is not None and not step.phase.endswith("/no_grad") and not in_backward()
