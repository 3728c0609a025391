"""Counters of the fetch coordinator: kept per step, frozen into ``CoordinatorStats`` at its end.

Bytes are counted from the coordinator's own calls, per rank, with the formula of
``parts.partition.coordinator.plan.collective_bytes``: gathering a parameter whose shard holds ``s``
elements of ``b`` bytes over ``w`` ranks counts ``(w - 1) * s * b`` (what this rank
receives), reduce-scattering its grad in fp32 counts ``(w - 1) * s * 4`` (what it sends).
A gather that travels as codes (``Compression(weights="int8")``) counts its codes, scales and
row alignment (``parts.comm.compressed.gather_bytes``), a gather from secondary shards what
the node group moved, reduce-scatters what the collective sent: the ledger's bytes.
Parameters already gathered or in flight cost nothing. All counters are plain integers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from parts.comm.counter import comm_counter, ledger_since


@dataclass
class StepCounters:
    """Mutable counters of the step in progress."""

    allgather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    allgather_calls: int = 0
    reduce_scatter_calls: int = 0
    fetches: int = 0
    on_demand_fetches: int = 0
    prefetch_hits: int = 0
    resident_hits: int = 0
    gathered_params: int = 0
    prefetched_params: int = 0
    regathered_params: int = 0
    evicted_params: int = 0
    persistent_gathers: int = 0
    live_high_water: int = 0
    param_gathers: dict = field(default_factory=dict)
    secondary_bytes: int = 0
    secondary_params: int = 0
    ledger_mark: dict = field(default_factory=comm_counter.by_group)  # the ledger when the last step ended

    def reset(self) -> None:
        """Zero every counter for the next step (the pieces of the coordinator share this object)."""
        fresh = StepCounters()
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))

    def gathered(self, pid: int, nbytes: int) -> None:
        """Count one parameter gathered by a collective."""
        self.allgather_bytes += nbytes
        self.gathered_params += 1
        self.param_gathers[pid] = self.param_gathers.get(pid, 0) + 1

    def gathered_many(self, pids: list[int], nbytes: list[int]) -> None:
        """Count parameters gathered by one collective (``nbytes[i]`` for ``pids[i]``)."""
        self.allgather_bytes += sum(nbytes)
        self.gathered_params += len(pids)
        counts = self.param_gathers
        for pid in pids:
            counts[pid] = counts.get(pid, 0) + 1


@dataclass(frozen=True)
class CoordinatorStats:
    """What the last finished step did, plus totals since ``attach``.

    ``fetches`` counts submodule fetches of non-persistent params; each is ``on_demand``
    (had to gather itself), a ``prefetch_hit`` (found every param already issued by a
    prefetch, in flight or done) or a ``resident_hit`` (all params still gathered from an
    earlier use). ``regathered_params``: gathers of a param already gathered earlier in the
    same pass (forward or backward); 0 unless reuse is off and a module runs twice, or
    a checkpointed region recomputes. ``live_high_water``: most non-persistent gathered (or
    in-flight) elements at once. ``param_gathers``: stable id -> gathers in the step.
    ``cached_bytes``: freed full-parameter memory the coordinator keeps for the next
    gathers (``cache_freed_storage``; see ``parts.base.storage_pool``).
    ``bytes_by_group``: bytes and calls per process group and kind (``comm_counter.by_group()``
    keys) of every collective of this process since the previous step ended: the step and what
    ran before it (an optimizer step, a hybrid layout's cross-replica all-reduce).
    ``residual_bytes``: memory of the error-feedback residuals a ``Compression`` with ``grads``
    keeps (core/compression.py); 0 without one.
    ``secondary_bytes``: with ``secondary_group`` (secondary.py), the most bytes of secondary
    shards held at once during the step (all are freed by its end); ``secondary_params``:
    parameters gathered from them over the node group.
    """

    steps: int
    phase: str
    allgather_bytes: int
    reduce_scatter_bytes: int
    allgather_calls: int
    reduce_scatter_calls: int
    fetches: int
    on_demand_fetches: int
    prefetch_hits: int
    resident_hits: int
    gathered_params: int
    prefetched_params: int
    regathered_params: int
    evicted_params: int
    persistent_gathers: int
    live_high_water: int
    param_gathers: dict
    trace_outcome: str
    trace_events: int
    trace_digest: str
    trace_misses: int
    persistent_params: int
    persistent_elements: int
    cached_bytes: int
    bytes_by_group: dict = field(default_factory=dict)
    residual_bytes: int = 0
    secondary_bytes: int = 0
    secondary_params: int = 0

    def __repr__(self) -> str:
        """A few lines: the step's traffic, fetches, memory and trace (``param_gathers`` summarised)."""
        gathers = sum(self.param_gathers.values())
        return (f"CoordinatorStats(step {self.steps}, {self.phase}:\n"
                f"  all-gathered {self.allgather_bytes:,} B in {self.allgather_calls} calls, "
                f"reduce-scattered {self.reduce_scatter_bytes:,} B in {self.reduce_scatter_calls} calls\n"
                f"  fetches {self.fetches} (on demand {self.on_demand_fetches}, prefetch hits "
                f"{self.prefetch_hits}, resident {self.resident_hits})\n  params gathered "
                f"{self.gathered_params} (prefetched {self.prefetched_params}, regathered "
                f"{self.regathered_params}, evicted {self.evicted_params}); {gathers} gathers over "
                f"{len(self.param_gathers)} params\n"
                f"  live high-water {self.live_high_water:,} elements, persistent "
                f"{self.persistent_params} params / {self.persistent_elements:,} elements "
                f"({self.persistent_gathers} gathers), cached {self.cached_bytes:,} B\n  secondary shards "
                f"{self.secondary_bytes:,} B at most ({self.secondary_params} params gathered from them)\n"
                f"  trace {self.trace_outcome}, {self.trace_events} events, {self.trace_misses} misses, "
                f"digest {self.trace_digest[:12]})")

    def as_dict(self) -> dict[str, Any]:
        """The stats as a plain dict."""
        return asdict(self)


def freeze(counters: StepCounters, **extra: Any) -> CoordinatorStats:
    """Snapshot ``counters`` with the step-level fields in ``extra``."""
    values = dict(vars(counters))
    values["param_gathers"] = dict(counters.param_gathers)
    values["bytes_by_group"] = ledger_since(values.pop("ledger_mark"), comm_counter.by_group())
    values.update(extra)
    return CoordinatorStats(**values)
