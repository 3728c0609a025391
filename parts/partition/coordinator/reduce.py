"""Gradient side of the coordinator: bucket complete full grads, reduce-scatter them.

``GradReducer`` is the third part of ``FetchCoordinator`` (with ``FetchEngine`` and the
hooks in coordinator.py). A parameter's full grad is queued once its last contribution
of the backward arrived; when the queue holds ``reduce_bucket_size`` elements it goes in
one group of reduce-scatters, async with ``overlap_comm`` so it runs while backward
computes the next bucket. At most two buckets are in flight; all have landed in the grad
shards when backward returns.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from parts.partition.core.grads import reduce_scatter_grads
from parts.partition.coordinator.plan import collective_bytes

__all__ = ["GradReducer"]

_REDUCE_ITEMSIZE = torch.float32.itemsize  # grads are reduce-scattered in fp32


class GradReducer:
    """Bucketing and reduce-scatter of full grads for a ``FetchCoordinator``."""

    def _setup_reducer(self) -> None:
        self._pending: list = []  # params whose full grad is complete, awaiting reduce-scatter
        self._pending_numel = 0
        self._reducing: list = []  # reduce-scatters in flight (overlap_comm)

    def _queue_grad(self, p: nn.Parameter, pid: int, phase: Optional[str]) -> None:
        """``p``'s grad is complete: queue it, reduce the bucket once it is full."""
        self._pending.append(p)
        self._pending_numel += self._sizes[pid]
        if self._pending_numel >= self.knobs.reduce_bucket_size:
            self._reduce(phase)

    def _reduce_all(self, phase: Optional[str]) -> None:
        """End of backward: reduce every grad still pending (also grads no hook announced,
        e.g. of a parameter unfrozen later) and wait until all have landed."""
        pending = {id(p) for p in self._pending}
        self._pending += [p for p in self._by_id.values() if p.grad is not None and id(p) not in pending]
        self._reduce(phase)
        self._wait_reduces()

    def _reduce(self, phase: Optional[str]) -> None:
        """Reduce-scatter the pending full grads (one group of collectives) into the grad shards."""
        params = [p for p in self._pending if p.grad is not None]
        self._pending, self._pending_numel = [], 0
        if not params:
            return
        self._check(self._steps.get(phase), "reduce", ids=[self._pids[id(p)] for p in params])
        self._counters.reduce_scatter_calls += 1
        for p in params:
            m = self._recs[self._pids[id(p)]]
            self._counters.reduce_scatter_bytes += collective_bytes(
                m.layout.shard_numel, m.world_size, _REDUCE_ITEMSIZE)
        handle = reduce_scatter_grads(params, self.group, async_op=self.knobs.overlap_comm)
        self._wait_reduces()  # the previous bucket: at most two buckets in flight
        if handle is not None:
            self._reducing.append(handle)

    def _wait_reduces(self) -> None:
        """Finish the reduce-scatters in flight (their slices land in the grad shards)."""
        reducing, self._reducing = self._reducing, []
        for handle in reducing:
            handle.wait()
