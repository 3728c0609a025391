"""The planner: a ``Plan`` from a ``ModelShape`` by arithmetic alone, no process group.

It replays one steady-state training step of the coordinator with the coordinator's own
pure decision functions (``parts.partition.coordinator.plan``, ``units``): fetch units chosen
by size, the trace (unit forwards in module order, backwards in reverse order of their
forwards' completion), persistent parameters refreshed once per step, reuse after use,
prefetch windows, eviction under the live budget, one reduce-scatter of every trainable
parameter's grad. Its assumption is the trace: modules run in the order they are registered,
each unit's output reaches the loss. Where a model runs otherwise, ``dry_run`` is the truth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from parts.base.layout import ShardLayout
from parts.partition.coordinator.plan import (Knobs, build_plan, choose_evictions, keep_after_use,
                                              next_use, prefetch_targets, select_persistent)
from parts.partition.coordinator.units import choose_units
from parts.plan.layout_bytes import Plan
from parts.plan.shapes import ModelShape


@dataclass(frozen=True)
class Widths:
    """Bytes per element: shards (``param``), gathered full tensors (``compute``), grads as
    reduced and accumulated (``reduce``) and optimizer state per element (``state``: AdamW's
    two moments in the shard dtype)."""

    param: int = 4
    compute: int = 4
    reduce: int = 4
    state: int = 8


def _walk(shape: ModelShape, sets: list, unit: tuple) -> list:
    """The forward of hooked units as ``(True, i)`` when unit ``i`` starts and ``(False, i)`` when
    it completes (children inside their parent), in module order."""
    hooked = [i for i in range(len(shape.names)) if unit[i] == i and (i == 0 or sets[i])]
    children: dict[int, list] = {i: [] for i in hooked}
    for i in hooked[1:]:
        parent = shape.parents[i]
        while parent not in children:
            parent = shape.parents[parent]
        children[parent].append(i)
    stream, stack = [], [(0, False)]
    while stack:
        index, finished = stack.pop()
        stream.append((not finished, index))
        if not finished:
            stack.append((index, True))
            stack.extend((child, False) for child in reversed(children[index]))
    return stream


@dataclass
class _Live:
    """The simulated live set of one step (mirrors the coordinator's ``LiveSet``)."""

    sizes: dict
    knobs: Knobs
    cost: dict  # id -> bytes a gather of it moves
    live: dict = field(default_factory=dict)
    uses: dict = field(default_factory=dict)
    held_back: dict = field(default_factory=dict)
    total: int = 0
    high: int = 0
    gathered: int = 0
    horizon: Optional[int] = None
    recheck: set = field(default_factory=set)

    def gather(self, ids: list, persistent: frozenset) -> None:
        for pid in dict.fromkeys(ids):
            if pid in persistent or pid in self.live:
                continue
            self.gathered += self.cost[pid]
            self.live[pid] = self.sizes[pid]
            self.total += self.sizes[pid]
            self.high = max(self.high, self.total)

    def release(self, ids: list) -> None:
        for pid in ids:
            if self.live.pop(pid, None) is not None:
                self.total -= self.sizes[pid]
                if self.horizon is not None:
                    self.recheck.add(pid)

    def settle(self, ids: list, plan: object, position: int) -> None:
        idle = [pid for pid in ids if pid in self.live and not self.uses.get(pid)]
        if idle:
            keep = keep_after_use(plan, position, idle, self.total, self.knobs.max_live_parameters,
                                  self.knobs.max_reuse_distance)
            self.release([pid for pid in idle if pid not in keep])

    def make_room(self, own: set, plan: object, position: int) -> None:
        excess = self.total - sum(self.live.get(pid, 0) for pid in own) - self.knobs.max_live_parameters
        if excess > 0:
            idle = [(pid, size, next_use(plan, pid, position)) for pid, size in self.live.items()
                    if pid not in own and not self.uses.get(pid)]
            self.release(list(choose_evictions(idle, excess)))


def _prefetch(state: _Live, plan: object, position: int, persistent: frozenset) -> None:
    """The coordinator's prefetch after a fetch: released ids due before the horizon, then the window."""
    if state.horizon == len(plan) and not state.recheck:
        return
    again, budget = [], state.knobs.max_live_parameters - state.total
    for pid in sorted(state.recheck):
        later = next_use(plan, pid, position)
        if later is None or state.horizon is None or later >= state.horizon or pid in state.live:
            state.recheck.discard(pid)
        elif state.sizes[pid] <= budget:
            budget -= state.sizes[pid]
            again.append(pid)
            state.recheck.discard(pid)
    extra = sum(state.sizes[pid] for pid in again)
    ids, state.horizon = prefetch_targets(plan, position, state.knobs.prefetch_bucket_size,
                                          state.total + extra, state.knobs.max_live_parameters,
                                          lambda pid: pid in state.live, start=state.horizon)
    state.gather(again + list(ids), persistent)


def _fetch(state: _Live, plan: object, position: int, ids: list, persistent: frozenset) -> None:
    state.make_room(set(ids), plan, position)
    state.gather(ids, persistent)
    for pid in set(ids):
        state.uses[pid] = state.uses.get(pid, 0) + 1
    _prefetch(state, plan, position, persistent)


def _step(shape: ModelShape, knobs: Knobs, cost: dict, persistent: frozenset) -> _Live:
    """Replay one steady-state step; the state holds bytes gathered and the live high-water mark."""
    units = choose_units(shape.parents, shape.own, shape.sizes,
                         min(knobs.fetch_unit_size, knobs.max_live_parameters), shape.coverable)
    sets = [list(ids) for ids in shape.own]
    for root, ids in units.members.items():
        sets[root] = list(ids)
    for index, pid in shape.reads:  # the coordinator adds a read parameter to the reader's unit
        unit = units.unit[index]
        if pid not in sets[unit]:
            sets[unit].append(pid)
    stream = _walk(shape, sets, units.unit)
    forward = [i for starts, i in stream if starts]
    backward = [i for starts, i in reversed(stream) if not starts]
    plan = build_plan([sets[i] for i in forward + backward], shape.sizes, persistent)
    state = _Live(shape.sizes, knobs, cost)
    state.gathered += sum(cost[pid] for pid in persistent if pid in shape.trainable)
    _forward(state, plan, stream, sets, persistent)
    _backward(state, plan, backward, len(forward), sets, persistent)
    return state


def _forward(state: _Live, plan: object, stream: list, sets: list, persistent: frozenset) -> None:
    """Fetch each unit as its forward starts; settle its parameters as it completes."""
    position = -1
    for starts, index in stream:
        if starts:
            position += 1
            _fetch(state, plan, position, sets[index], persistent)
            continue
        ids = list(dict.fromkeys(sets[index]))
        for pid in ids:
            state.uses[pid] = state.uses.get(pid, 0) - 1
        state.settle(ids, plan, position)


def _backward(state: _Live, plan: object, backward: list, start: int, sets: list,
              persistent: frozenset) -> None:
    """Fetch each unit as its backward starts; a parameter settles after its last backward use."""
    last = {}
    for k, index in enumerate(backward):
        for pid in sets[index]:
            last[pid] = k
    for k, index in enumerate(backward):
        position = start + k
        _fetch(state, plan, position, sets[index], persistent)
        for pid in set(sets[index]):
            state.held_back[pid] = state.held_back.get(pid, 0) + 1
        for pid in dict.fromkeys(sets[index]):
            if last[pid] == k:
                state.uses[pid] -= state.held_back.pop(pid, 0)
                state.settle([pid], plan, position)


REPLICA_BUCKET_NUMEL = 25_000_000  # parts.partition.core.replicas.BUCKET_NUMEL


def replica_all_reduce_bytes(shard_numels: list[int], replicas: int, width: int,
                             bucket_numel: int = REPLICA_BUCKET_NUMEL) -> int:
    """Bytes of the cross-replica mean of a hybrid layout's grad shards (id order, buckets of at
    most ``bucket_numel`` elements, each all-reduce counted ``2 (r - 1) / r`` of its bytes)."""
    if replicas <= 1:
        return 0
    total, run = 0, 0
    for n in shard_numels + [None]:
        if n is None or (run and run + n > bucket_numel):
            total += 2 * (replicas - 1) * run * width // replicas
            run = 0
        if n is not None:
            run += n
    return total


def estimate(shape: ModelShape, world_size: int, knobs: Optional[Knobs] = None,
             widths: Optional[Widths] = None, *, shard_size: Optional[int] = None) -> Plan:
    """The plan of ``shape`` over ``world_size`` ranks with the coordinator ``knobs``: model
    states from the shard layouts, traffic and the gathered peak from a replayed step.
    ``shard_size``: a hybrid layout sharded within groups of that many ranks and replicated
    across ``world_size / shard_size`` of them (grads averaged once per step); default: full sharding."""
    knobs, widths = knobs or Knobs(), widths or Widths()
    k = shard_size or world_size
    if world_size % k:
        raise ValueError(f"estimate: shard_size {k} does not divide world_size {world_size}")
    shard = {pid: ShardLayout(n, k).shard_numel for pid, n in shape.sizes.items()}
    cost = {pid: (k - 1) * s * widths.compute for pid, s in shard.items()}
    persistent = select_persistent(shape.sizes, knobs.persistence_threshold, knobs.model_persistence_threshold)
    state = _step(shape, knobs, cost, persistent)
    trained = sorted(pid for pid in shape.sizes if pid in shape.trainable)
    return Plan(world_size=world_size, params=shape.params,
                param_bytes=sum(shard.values()) * widths.param,
                grad_bytes=sum(shard[pid] for pid in trained) * widths.reduce,
                optimizer_bytes=sum(shard[pid] for pid in trained) * widths.state,
                persistent_bytes=sum(shape.sizes[pid] for pid in persistent) * widths.compute,
                gathered_peak_bytes=state.high * widths.compute,
                allgather_bytes=state.gathered,
                reduce_scatter_bytes=sum((k - 1) * shard[pid] * widths.reduce for pid in trained),
                all_reduce_bytes=replica_all_reduce_bytes([shard[pid] for pid in trained], world_size // k,
                                                          widths.reduce),
                shard_size=k)


def model_states_at(shape: ModelShape, world_size: int, widths: Widths) -> int:
    """Bytes of parameter and grad shards and optimizer state per rank under full sharding over ``world_size``."""
    trained = widths.param + widths.reduce + widths.state
    return sum(ShardLayout(n, world_size).shard_numel * (trained if pid in shape.trainable else widths.param)
               for pid, n in shape.sizes.items())


def smallest_world(shape: ModelShape, widths: Widths, fixed_bytes: int, limit_bytes: float, world_size: int,
                   ranks_per_node: int) -> Optional[int]:
    """The smallest world size above ``world_size`` (whole nodes of ``ranks_per_node`` once past one
    node) whose model states plus ``fixed_bytes`` (what does not shrink with the world) fit
    ``limit_bytes`` per rank under full sharding; None if none does."""
    def fits(n: int) -> bool:
        return fixed_bytes + model_states_at(shape, n, widths) <= limit_bytes
    for n in range(world_size + 1, ranks_per_node + 1):
        if fits(n):
            return n
    largest = max(shape.sizes.values(), default=1)
    lo, hi = max(world_size, ranks_per_node) // ranks_per_node + 1, -(-largest // ranks_per_node)
    if lo > hi:
        hi = lo
    if not fits(hi * ranks_per_node):
        return None
    while lo < hi:  # model states shrink as the world grows: the first node count that fits
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid * ranks_per_node) else (mid + 1, hi)
    return lo * ranks_per_node
