"""The grad reducer of the coordinator: bucket complete full grads, reduce-scatter them.

A parameter's full grad is handed over (``grad_ready``) once its last contribution of the
backward arrived; when the bucket holds ``reduce_bucket_size`` elements it goes in one group
of reduce-scatters (the core's ``reduce_scatter_grads``), async with ``overlap_comm`` so it
runs while backward computes the next bucket. At most two buckets are in flight; ``flush``
at the end of backward reduces the rest and waits until every grad shard has landed. The
grads of the flat persistent params (flat.py) are reduce-scattered there, as one.

In a hybrid layout each bucket's cross-replica mean is issued as soon as its reduce-scatter
landed and runs while backward goes on (``replica_sync`` "backward", the default), unless this
backward runs under ``no_sync`` (``deferred``): then the grad shards stay pending, summed over
micro-batches, and the next backward outside it (or the optimizer step) averages them once.

In reproducible mode (``exact``) the buckets go through ``reduce_scatter_exact`` (int64 sums,
core/exact_grads.py) and the cross-replica sum waits for the step (core/exact.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from parts.comm import GroupArg, Waitable, WeakGroup, comm_counter
from parts.partition.coordinator.debug import StepCheck
from parts.partition.coordinator.flat import FlatReduce, reduce_counted
from parts.partition.coordinator.plan import Knobs
from parts.partition.coordinator.stats import StepCounters
from parts.partition.coordinator.step import StepState
from parts.partition.coordinator.table import ParamTable
from parts.partition.coordinator.uneven import REDUCE, CollectiveLog
from parts.partition.core.grad_guard import raw_grad, set_raw_grad
from parts.partition.core.exact_grads import reduce_scatter_exact
from parts.partition.core.grads import reduce_scatter_grads
from parts.partition.core.replicas import InFlight, sync_replica_grads


class GradReducer:
    """Buckets of complete full grads and the reduce-scatters in flight of one coordinator."""

    group = WeakGroup()  # not kept alive past destroy_process_group (see WeakGroup)

    def __init__(self, table: ParamTable, knobs: Knobs, group: GroupArg, check: StepCheck,
                 counters: StepCounters, reduce_dtype: torch.dtype = torch.float32,
                 flat: Optional[FlatReduce] = None) -> None:
        self.table, self.knobs, self.group, self.check, self.counters = table, knobs, group, check, counters
        self.flat = flat  # the flat persistent params' grads (flat.py), reduced as one at the end
        self._others: list[nn.Parameter] = []
        self.follow(force=True)
        self.reduce_dtype = reduce_dtype  # grads are summed in it (MixedPrecision.reduce_dtype)
        self._pending: list[nn.Parameter] = []  # complete full grads awaiting reduce-scatter
        self._pending_numel = 0
        self._reducing: list[tuple[Waitable, list]] = []  # reduce-scatters in flight (overlap_comm), their records
        self.replica_sync = "backward"  # hybrid layouts: the cross-replica mean in each backward, or at the step
        self.deferred = False  # this backward runs under no_sync: its cross-replica mean waits
        self.replicating = InFlight()  # with "backward": cross-replica all-reduces issued as buckets land
        self.log: Optional[CollectiveLog] = None  # the reduce-scatters, agreed at a backward's end (uneven.py)
        self.exact = False  # reproducible mode: fixed-point sums (core/exact_grads.py)

    def follow(self, force: bool = False) -> None:
        """At a backward's start: the flat reduce-scatter's members are the flat parameters that
        require grad now (flat.py); every other parameter's grad goes the per-parameter way."""
        if self.flat is None or not (self.flat.follow() or force):
            return
        flat_ids = set(self.flat.pids)
        self._others = [p for pid, p in self.table.params.items() if pid not in flat_ids]

    def grad_ready(self, p: nn.Parameter, pid: int, step: Optional[StepState]) -> None:
        """``p``'s grad is complete: queue it, reduce the bucket once it is full."""
        self._pending.append(p)
        self._pending_numel += self.table.sizes[pid]
        if self._pending_numel >= self.knobs.reduce_bucket_size:
            self._reduce(step)

    def flush(self, step: Optional[StepState]) -> None:
        """End of backward: reduce every grad still pending (also grads no hook announced,
        e.g. of a parameter unfrozen later) and wait until all have landed. The flat persistent
        params go first, in one reduce-scatter of their own when every one has its grad."""
        scan = self.table.params.values()
        if self.flat is not None and self.flat.ready():
            self.check.point(step, "reduce", ids=self.flat.pids)
            reduce_counted(self.flat, self.counters)
            scan = self._others
        pending = {id(p) for p in self._pending}
        self._pending += [p for p in scan if raw_grad(p) is not None and id(p) not in pending]
        self._reduce(step)
        self.wait(replicate=False)
        if self.overlaps():  # the last bucket with the flat ones and any earlier ones
            self.replicating.start(self.table.records.values())
            self.replicating.finish()
            sync_replica_grads(self.table.records.values())  # what arrived since

    def overlaps(self) -> bool:
        """True if this backward issues the cross-replica means as the buckets land."""
        return self.replica_sync == "backward" and not self.deferred and not self.exact

    def _reduce(self, step: Optional[StepState]) -> None:
        """Reduce-scatter the pending full grads (one group of collectives) into the grad shards."""
        params = [p for p in self._pending if raw_grad(p) is not None]
        self._pending, self._pending_numel = [], 0
        if not params:
            return
        ids = [self.table.pid(p) for p in params]
        self.check.point(step, "reduce", ids=ids)
        if self.log is not None:
            self.log.note(REDUCE, sorted(ids))
        self.counters.reduce_scatter_calls += 1
        sent = comm_counter.reduce_scatter_bytes  # the wire bytes (bf16 grads may travel as bf16)
        if self.exact:
            handle = reduce_scatter_exact(params, self.group, async_op=self.knobs.overlap_comm)
        else:
            handle = reduce_scatter_grads(params, self.group, async_op=self.knobs.overlap_comm,
                                          dtype=self.reduce_dtype)
        self.counters.reduce_scatter_bytes += comm_counter.reduce_scatter_bytes - sent
        self.wait()  # the previous bucket: at most two buckets in flight
        if handle is not None:
            self._reducing.append((handle, [self.table.records[i] for i in ids]))

    def discard(self) -> None:
        """A failed backward's leftovers (abort.py): its pending full grads are dropped, its
        reduce-scatters in flight waited for (every rank started them) and their slices not added."""
        for p in self._pending:
            set_raw_grad(p, None)
        self._pending, self._pending_numel = [], 0
        reducing, self._reducing = self._reducing, []
        for handle, _ in reducing:
            handle.discard()
        self.replicating.finish()  # every replica issued them

    def wait(self, replicate: bool = True) -> None:
        """Finish the reduce-scatters in flight (their slices land in the grad shards); with
        ``replicate`` and the "backward" sync, issue the cross-replica mean of each as it lands."""
        reducing, self._reducing = self._reducing, []
        for handle, records in reducing:
            handle.wait()
            if replicate and self.overlaps():  # runs while backward goes on
                self.replicating.start(records)
