"""The whole-tensor path: each parameter stepped whole by one owner rank (ZeRO-1 by whole tensors).

``WholeStepper`` takes over an optimizer's sharded parameters. Each gets an owner
(``parts.base.owners.OwnerPlan``, balanced by size); in the optimizer's param groups the owner
holds a full-shape tensor, every other rank an empty placeholder that never has a grad, so
the optimizer's state for a parameter exists on its owner only. Before each step one
all-to-all brings every rank's grad shard of a parameter to its owner (the grads were averaged
by the reduce-scatter already: together the two move what one reduce to the owner would); the
owner keeps its full copy of the values between steps, and the value shards travel too only
where a shard changed since (the first step, a loaded checkpoint: a one-flag-per-parameter
all-reduce says so). The user's optimizer then steps the full tensors with their full grads;
after it one all-to-all sends each rank its shard of the updated values. The grad shards stay until
``optimizer.zero_grad()``, which clears them.
"""

from __future__ import annotations

from typing import Any

import torch

from parts.comm import ReduceOp, all_reduce, all_to_all, comm_device
from parts.partition.core.param import alloc, internal, shard_version
from parts.partition.whole.full import FullStepper
from parts.partition.whole.full import size as fmt


class WholeStepper(FullStepper):
    """Owners, full tensors and the two exchanges of one optimizer on the whole-tensor path."""

    path = "whole"

    def __init__(self, optimizer: torch.optim.Optimizer, records: list) -> None:
        super().__init__(optimizer, records)
        self._hold([self._slot(j, m) for j, m in enumerate(self.records)])

    def _slot(self, j: int, m: Any) -> torch.Tensor:
        """The full tensor on the owner of parameter ``j``; an empty placeholder elsewhere."""
        if self.plan.owners[j] == self.info.rank:
            return torch.zeros(m.shape, dtype=self.dtype, device=m.shard.device)
        return torch.empty(0, dtype=self.dtype, device=m.shard.device)

    def costs(self) -> str:
        """Memory per rank and bytes per step, for the log line."""
        size, world = self.nbytes(), self.info.world_size
        return (f"each owner holds its parameters' full values, grads and state (about {fmt(2 * size / world)} "
                f"of values and grads per rank on balanced owners); each step sends the grad shards to the "
                f"owners and the updated shards back, {fmt(2 * size * (world - 1) / world / world)} out of each "
                f"rank")

    def _stale(self) -> list[bool]:
        """Per parameter: has any rank's shard changed since the owner's full copy was last made?
        (a tiny all-reduce; the first step, a loaded checkpoint or a re-sharded weight say yes)"""
        mine = [self.stamps[j] != shard_version(m) for j, m in enumerate(self.records)]
        flags = torch.tensor(mine, dtype=torch.int32, device=comm_device(self.info))
        return [bool(f) for f in all_reduce(flags, self.info, ReduceOp.MAX).tolist()]

    @internal
    def before(self) -> None:
        """Bring every rank's grad shards (and value shards where the owner's copy is stale) to the
        owners; give the full tensors their grads."""
        self._to_owners(self._stale())

    @internal
    def after_closure(self) -> None:
        """Bring the grad shards a closure's backward made to the owners (the values are current there)."""
        self._to_owners([False] * len(self.records))

    def _to_owners(self, stale: list[bool]) -> None:
        rank, device = self.info.rank, comm_device(self.info)
        pieces = [2 if s else 1 for s in stale]
        send_splits, recv_splits = self.plan.to_owners(rank, pieces)
        parts = [piece for d in range(self.info.world_size) for j in self.plan.owned(d)
                 for piece in self._pieces(self.records[j], stale[j])]
        send = torch.cat(parts).to(device) if parts else torch.empty(0, dtype=self.dtype, device=device)
        recv = alloc(sum(recv_splits), self.dtype, device)
        all_to_all(recv, send, recv_splits, send_splits, self.info)
        owned = self.plan.owned(rank)
        for j, t in enumerate(self.tensors):
            if self.plan.owners[j] != rank:
                t.grad = None  # a placeholder never steps (a state-making step gives every tensor a grad)
        sizes = [pieces[i] * self.plan.shard_numels[i] for i in owned]
        chunks = [c.split(sizes) for c in recv.split(recv_splits)]
        for k, j in enumerate(owned):
            self._assemble(j, [c[k] for c in chunks], stale[j])

    def _pieces(self, m: Any, stale: bool) -> tuple[torch.Tensor, ...]:
        grad = m.grad_shard
        grad = torch.zeros_like(m.shard) if grad is None else grad.to(self.dtype).reshape(-1)
        return (grad, m.shard.detach()) if stale else (grad,)

    def _assemble(self, j: int, pieces: list[torch.Tensor], stale: bool) -> None:
        """The full grad of ``j`` (and its values, if stale) from each rank's pieces."""
        m, full = self.records[j], self.tensors[j]
        sn = self.plan.shard_numels[j]
        if stale:
            full.detach().copy_(torch.cat([p[sn:] for p in pieces])[:m.numel].view(m.shape))
        if m.grad_shard is not None:  # else keep a grad set on the full tensor itself (a state-making lr-0 step)
            full.grad = torch.cat([p[:sn] for p in pieces])[:m.numel].view(m.shape).to(full.device)

    @internal
    def after(self) -> None:
        """Send each rank its shard of the updated full tensors; drop the full grads."""
        self._from_owners()
        rank = self.info.rank
        for j, t in enumerate(self.tensors):
            t.grad = None
            if self.plan.owners[j] != rank:  # a state-making step gave placeholders state: not theirs to keep
                for optimizer in self.optimizers():
                    optimizer.state.pop(t, None)

    @internal
    def before_closure(self) -> None:
        """Send each rank its shard of the owners' current values (a closure's forward reads the shards)."""
        self._from_owners()

    def _from_owners(self) -> None:
        rank, world, device = self.info.rank, self.info.world_size, comm_device(self.info)
        send_splits, recv_splits = self.plan.from_owners(rank)
        flats = []
        for j in self.plan.owned(rank):
            sn, full = self.plan.shard_numels[j], self.tensors[j]
            flat = torch.zeros(sn * world, dtype=self.dtype, device=device)
            flat[:full.numel()].copy_(full.detach().reshape(-1))
            flats.append(flat.view(world, sn))
        send = torch.cat([f[d] for d in range(world) for f in flats]) if flats else \
            torch.empty(0, dtype=self.dtype, device=device)
        recv = alloc(sum(recv_splits), self.dtype, device)
        all_to_all(recv, send, recv_splits, send_splits, self.info)
        for d, chunk in enumerate(recv.split(recv_splits)):
            mine = self.plan.owned(d)
            for j, piece in zip(mine, chunk.split([self.plan.shard_numels[i] for i in mine])):
                self.records[j].shard.detach().copy_(piece.to(self.records[j].shard.device))
        self.stamps = [shard_version(m) for m in self.records]  # the owners' copies equal the shards now
