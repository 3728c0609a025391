"""Fetch planning for the coordinator: pure arithmetic on traces and parameter sizes, no torch.

Parameters are named by their stable ids (identical on every rank), sizes are element counts.
A ``StepPlan`` lays a trace out as the sequence of (non-persistent) parameter sets fetched at
each position; from it follow the prefetch window, the reuse distance of a parameter and the
eviction order under the live-element budget.

Communication volume (what ``stats()`` counts, per rank): gathering a parameter whose shard
holds ``s`` elements of ``b`` bytes over ``w`` ranks receives ``(w - 1) * s * b`` bytes; a
reduce-scatter of its grad in dtype of ``b'`` bytes sends ``(w - 1) * s * b'`` bytes. These
are the ring-algorithm volumes ``(w - 1) / w`` of the padded flat buffer.
"""

from __future__ import annotations

import bisect
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence

_INT_KNOBS = ("prefetch_bucket_size", "max_reuse_distance", "max_live_parameters",
              "persistence_threshold", "model_persistence_threshold", "reduce_bucket_size",
              "fetch_unit_size")


@dataclass(frozen=True)
class Knobs:
    """Validated settings of a ``FetchCoordinator`` (all sizes in elements).

    ``prefetch_bucket_size``: how far ahead prefetch reaches (0: off).
    ``max_reuse_distance``: a released-after-use parameter stays gathered if the trace needs it
    again after fewer than this many elements of other fetches (0: always release, the 3x
    communication schedule). ``max_live_parameters``: budget of non-persistent gathered (or
    in-flight) elements; prefetch and reuse stay within it and a fetch first releases idle
    parameters (farthest next use first), so it is exceeded only by the parameters of the
    modules running at that moment (the current one, running ancestors, tied parameters
    waiting for their last backward use). ``persistence_threshold`` /
    ``model_persistence_threshold``: parameters of at most that many elements (smallest first,
    up to that total) are gathered at the start of the first step, all in one collective, and
    stay gathered for good. At the start of every later step those whose shard changed since
    they were gathered (an optimizer stepped it: ``parts.partition.core.param.is_stale``) are
    gathered again, in one collective, so no stale full copy is ever used: one gather of them
    per optimizer step, none for steps without an update (evaluation, accumulation).
    ``cache_freed_storage``: released full parameters' memory is kept for the next gathers of
    that size instead of going back to the host allocator (CPU only; ``parts.base.storage_pool``).
    ``fetch_unit_size``: a submodule whose subtree holds at most this many elements (and at
    most ``max_live_parameters``) is one fetch unit, gathered and released as one, with hooks
    on it alone (``units.py``; a transformer block, or a whole small model); 0: every
    submodule fetches its own parameters.
    ``reproducible``: grads are summed in fixed point (int64, core/exact_grads.py), so the grad
    shards, and the weights a run steps to, are the same bits at every world size that computes
    the same units (``parts.partition.reproducible``; docs/reproducibility.md).
    """

    prefetch_bucket_size: int = 5_000_000
    max_reuse_distance: int = 5_000_000
    max_live_parameters: int = 1_000_000_000
    persistence_threshold: int = 100_000
    model_persistence_threshold: int = sys.maxsize
    overlap_comm: bool = True
    debug: bool = False
    reduce_bucket_size: int = 5_000_000
    cache_freed_storage: bool = True
    fetch_unit_size: int = 5_000_000
    reproducible: bool = False

    def __post_init__(self) -> None:
        for name in _INT_KNOBS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"FetchCoordinator: {name} must be an int (elements), "
                                f"got {type(value).__name__} {value!r}")
            if value < 0:
                raise ValueError(f"FetchCoordinator: {name} must be >= 0, got {value}")
        for name in ("overlap_comm", "debug", "cache_freed_storage", "reproducible"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"FetchCoordinator: {name} must be a bool, got {getattr(self, name)!r}")


def select_persistent(sizes: Mapping[int, int], threshold: int, budget: int) -> frozenset:
    """Ids of params with at most ``threshold`` elements, smallest first, while their total fits ``budget``."""
    chosen, total = [], 0
    for pid, numel in sorted(sizes.items(), key=lambda kv: (kv[1], kv[0])):
        if numel > threshold or total + numel > budget:
            break
        chosen.append(pid)
        total += numel
    return frozenset(chosen)


def collective_bytes(shard_numel: int, world_size: int, itemsize: int) -> int:
    """Bytes one rank receives (all-gather) or sends (reduce-scatter) for one shard: ``(w-1)*s*b``."""
    return (world_size - 1) * shard_numel * itemsize


@dataclass(frozen=True)
class StepPlan:
    """Parameter sets along a trace with the tables prefetch and reuse decisions need."""

    sets: tuple  # sets[k]: ids fetched at trace position k (persistent ones left out)
    sizes: Mapping[int, int]
    prefix: tuple  # prefix[k]: elements of sets[0..k-1]
    occurrences: Mapping[int, tuple]  # id -> ascending positions that fetch it

    def __len__(self) -> int:
        return len(self.sets)


def build_plan(module_sets: Sequence[Sequence[int]], sizes: Mapping[int, int],
               persistent: Iterable[int] = ()) -> StepPlan:
    """Plan for a trace whose k-th event fetches ``module_sets[k]`` (ids into ``sizes``)."""
    skip = frozenset(persistent)
    sets, prefix, occurrences = [], [0], {}
    for position, ids in enumerate(module_sets):
        kept = tuple(dict.fromkeys(pid for pid in ids if pid not in skip))
        sets.append(kept)
        prefix.append(prefix[-1] + sum(sizes[pid] for pid in kept))
        for pid in kept:
            occurrences.setdefault(pid, []).append(position)
    return StepPlan(tuple(sets), dict(sizes), tuple(prefix),
                    {pid: tuple(pos) for pid, pos in occurrences.items()})


def next_use(plan: StepPlan, pid: int, after: int) -> Optional[int]:
    """First position > ``after`` that fetches ``pid``, or None if it is not used again."""
    positions = plan.occurrences.get(pid, ())
    i = bisect.bisect_right(positions, after)
    return positions[i] if i < len(positions) else None


def reuse_distance(plan: StepPlan, position: int, later: int) -> int:
    """Elements fetched strictly between ``position`` and ``later`` (``later > position``)."""
    return plan.prefix[later] - plan.prefix[position + 1]


def keep_after_use(plan: StepPlan, position: int, candidates: Sequence[int], live: int,
                   max_live: int, max_reuse_distance: int) -> frozenset:
    """Which ``candidates`` (done at ``position``) stay gathered: those used again after fewer than
    ``max_reuse_distance`` elements of other fetches (0 keeps none), nearest first, while the
    ``live`` elements (candidates included) minus those released stay within ``max_live``."""
    ranked = []
    for pid in dict.fromkeys(candidates):
        later = next_use(plan, pid, position)
        if later is not None and reuse_distance(plan, position, later) < max_reuse_distance:
            ranked.append((later, pid))
    base = live - sum(plan.sizes[pid] for pid in dict.fromkeys(candidates))
    kept = []
    for _, pid in sorted(ranked):
        if base + plan.sizes[pid] > max_live:
            break
        base += plan.sizes[pid]
        kept.append(pid)
    return frozenset(kept)


def prefetch_targets(plan: StepPlan, position: int, bucket: int, live: int, max_live: int,
                     resident: Callable[[int], bool], start: Optional[int] = None) -> tuple:
    """``(ids, horizon)``: ids to gather ahead after ``position``, whole upcoming sets from ``start``
    (default ``position + 1``; earlier ones were already covered) while the window (elements of
    the sets from ``position + 1`` on) is below ``bucket`` and ``live`` plus the new elements
    stays within ``max_live``; ``horizon`` is the first position not covered."""
    first = position + 1 if start is None else max(start, position + 1)
    if bucket <= 0:
        return (), first
    window = plan.prefix[first] - plan.prefix[position + 1]
    new_total, seen, targets = 0, set(), []
    for k in range(first, len(plan.sets)):
        if window >= bucket:
            return tuple(targets), k
        new = [pid for pid in plan.sets[k] if pid not in seen and not resident(pid)]
        new_size = sum(plan.sizes[pid] for pid in new)
        if live + new_total + new_size > max_live:
            return tuple(targets), k
        seen.update(new)
        window += plan.prefix[k + 1] - plan.prefix[k]
        new_total += new_size
        targets.extend(new)
    return tuple(targets), len(plan.sets)


def prefetch_chunks(ids: Sequence[int], positions: Sequence[int], sizes: Mapping[int, int],
                    min_chunk: int) -> list:
    """Split prefetch ``ids`` into one gather per trace position (in position order), merging a
    chunk of fewer than ``min_chunk`` elements with the next: the nearest module's gather
    completes first instead of waiting for one collective over the whole window."""
    order = sorted(range(len(ids)), key=lambda i: positions[i])
    chunks, current, size, last = [], [], 0, None
    for i in order:
        if current and positions[i] != last and size >= min_chunk:
            chunks.append(tuple(current))
            current, size = [], 0
        current.append(ids[i])
        size += sizes[ids[i]]
        last = positions[i]
    if current:
        chunks.append(tuple(current))
    return chunks


def choose_evictions(candidates: Sequence[tuple], excess: int) -> tuple:
    """From ``(id, size, next_use or None)`` pick ids to release, farthest next use first,
    until at least ``excess`` elements are freed (all of them if that is not enough)."""
    if excess <= 0:
        return ()
    order = sorted(candidates, key=lambda c: (c[2] is not None, -(c[2] or 0), c[0]))
    chosen, freed = [], 0
    for pid, size, _ in order:
        if freed >= excess:
            break
        chosen.append(pid)
        freed += size
    return tuple(chosen)
