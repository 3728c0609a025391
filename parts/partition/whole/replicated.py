"""The replicated path: every rank steps every full tensor, so any optimizer gives one process's result.

An optimizer whose update couples tensors (a sum or norm over all parameters: D-adaptation,
Prodigy, AdamS, Lamb's ``pre_norm``; a line search or a closure called more than once:
LBFGS, SAM) needs every parameter at once. ``ReplicatedStepper`` gives it that: each rank
holds a full-shape tensor for every parameter in the optimizer's param groups. Before each
step one all-gather brings every rank's grad shards (the grads were averaged by the
reduce-scatter already) to every rank, with the value shards where a shard changed since the
full copies were made (the first step, a loaded checkpoint). Each rank then runs the user's
optimizer on the same values, grads and state, which is the same deterministic math as one
process, and writes its own elements of the result into its shard: no second exchange.

The copies are checked, not trusted: with the per-parameter stale flags, one all-reduce
carries a fingerprint of each rank's full values and state. Where ranks differ (a kernel
that is not deterministic across processes, state loaded on some ranks only), the values are
gathered again from the shards and each parameter's state is taken from its owner
(``parts.base.owners.OwnerPlan``; the owner is also the rank whose state a checkpoint saves).

Memory per rank: the full values and grads of every parameter and the optimizer's state for
all of them (as without sharding). Bytes per step: one all-gather of the grad shards.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from parts.comm import ReduceOp, all_gather, all_gather_objects, all_reduce, comm_device
from parts.partition.core.param import alloc, internal, shard_version
from parts.partition.whole.full import FullStepper
from parts.partition.whole.full import size as fmt

logger = logging.getLogger("parts.partition")


def _checksum(t: Any) -> torch.Tensor:
    """A float64 sum that is equal on two ranks when ``t`` is bitwise equal (non-finite values count as finite)."""
    if torch.is_tensor(t):
        if not (t.is_floating_point() or t.is_complex()):
            t = t.double()
        t = torch.view_as_real(t) if t.is_complex() else t
        return torch.nan_to_num(t.detach().double(), nan=0.5, posinf=1.5, neginf=-1.5).sum()
    return torch.tensor(float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0,
                        dtype=torch.float64)


class ReplicatedStepper(FullStepper):
    """Every rank's full copy of every parameter, kept equal across ranks, stepped by the user's optimizer."""

    path = "replicated"

    def __init__(self, optimizer: torch.optim.Optimizer, records: list) -> None:
        super().__init__(optimizer, records)
        self._hold([torch.zeros(m.shape, dtype=self.dtype, device=m.shard.device) for m in self.records])
        sizes = [m.layout.shard_numel for m in self.records]
        self.offsets = [sum(sizes[:j]) for j in range(len(sizes) + 1)]

    def costs(self) -> str:
        """Memory per rank and bytes per step, for the log line."""
        size, world = self.nbytes(), self.info.world_size
        return (f"every rank holds the full values and grads of all {len(self.records)} parameters "
                f"({fmt(2 * size)}) and the optimizer's state for all of them; each step all-gathers "
                f"the grad shards, {fmt(size * (world - 1) / world)} into each rank")

    def _fingerprint(self) -> torch.Tensor:
        """One number from this rank's full values and the optimizer's state (equal where they are)."""
        sums = [_checksum(t) for t in self.tensors]
        for optimizer in self.optimizers():
            for t in self.tensors:
                entry = optimizer.state.get(t) or {}
                sums.extend(_checksum(entry[k]) for k in sorted(entry, key=str))
        device = self.tensors[0].device
        weights = torch.arange(1, len(sums) + 1, dtype=torch.float64, device=device)
        return (torch.stack([s.to(device) for s in sums]) * weights).sum()

    def _check(self) -> tuple[list[bool], bool]:
        """(per parameter: did any rank's shard change since the copies were made, do the ranks' copies
        differ): one all-reduce."""
        mine = [float(self.stamps[j] != shard_version(m)) for j, m in enumerate(self.records)]
        fingerprint = float(self._fingerprint())
        flags = torch.tensor(mine + [fingerprint, -fingerprint], dtype=torch.float64, device=comm_device(self.info))
        flags = all_reduce(flags, self.info, ReduceOp.MAX).tolist()
        return [f > 0 for f in flags[:len(mine)]], flags[-2] != -flags[-1]

    @internal
    def before(self) -> None:
        """All-gather the grad shards (and the value shards where stale) into every rank's full tensors."""
        stale, differ = self._check()
        if differ:
            logger.warning("parts.partition: the ranks' full copies of %s's parameters or state differ; taking the "
                           "values from the shards and each parameter's state from its owner",
                           type(self.optimizers()[0]).__name__ if self.optimizers() else "an optimizer")
            self._share_state()
        self._gather([s or differ for s in stale])

    @internal
    def after_closure(self) -> None:
        """All-gather the grad shards a closure's backward made into the full grads."""
        self._gather([False] * len(self.records))

    def _gather(self, stale: list[bool]) -> None:
        device, world, n = comm_device(self.info), self.info.world_size, self.offsets[-1]
        grads = [m.grad_shard is not None for m in self.records]
        values = any(stale)
        send = alloc(n * (1 + values), self.dtype, device)
        for j, m in enumerate(self.records):
            lo, hi = self.offsets[j], self.offsets[j + 1]
            if grads[j]:
                send[lo:hi].copy_(m.grad_shard.reshape(-1))
            else:
                send[lo:hi].zero_()
            if values:
                send[n + lo:n + hi].copy_(m.shard.detach().reshape(-1))
        recv = alloc(send.numel() * world, self.dtype, device)
        all_gather(recv, send, self.info)
        pieces = recv.view(world, -1)
        for j, (m, full) in enumerate(zip(self.records, self.tensors)):
            lo, hi = self.offsets[j], self.offsets[j + 1]
            if stale[j]:
                full.detach().copy_(pieces[:, n + lo:n + hi].reshape(-1)[:m.numel].view(m.shape))
            if grads[j]:  # else keep a grad set on the full tensor itself (a state-making lr-0 step)
                full.grad = pieces[:, lo:hi].reshape(-1)[:m.numel].view(m.shape).to(full.device, copy=True)

    @internal
    def after(self) -> None:
        """Write this rank's elements of the stepped full tensors into its shards; drop the full grads."""
        self.before_closure()
        for full in self.tensors:
            full.grad = None

    @internal
    def before_closure(self) -> None:
        """Write this rank's elements of the current full values into its shards (a closure's forward reads them)."""
        rank = self.info.rank
        for m, full in zip(self.records, self.tensors):
            start, stop = m.layout.range(rank)
            if stop > start:
                m.shard.detach()[:stop - start].copy_(full.detach().reshape(-1)[start:stop].to(m.shard.device))
        self.stamps = [shard_version(m) for m in self.records]

    def _share_state(self) -> None:
        """Every rank takes each parameter's state from its owner."""
        for optimizer in self.optimizers():
            mine = {j: optimizer.state[self.tensors[j]] for j in self.plan.owned(self.info.rank)
                    if self.tensors[j] in optimizer.state}
            theirs: dict[int, Any] = {}
            for part in all_gather_objects(mine, self.info.group):
                theirs.update(part)
            for j, full in enumerate(self.tensors):
                entry = theirs.get(j)
                if entry is None:
                    optimizer.state.pop(full, None)
                else:
                    optimizer.state[full] = {k: v.to(full.device) if torch.is_tensor(v) else v
                                             for k, v in entry.items()}
