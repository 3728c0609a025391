"""What the two full-tensor paths share: the parameters they take over, their owners, the shard
stamps that say when a full copy is stale, and a ``zero_grad`` that also clears the grad shards.

A ``FullStepper`` (``WholeStepper``: owners step full tensors; ``ReplicatedStepper``: every rank
steps every full tensor) puts full-shape tensors in an optimizer's param groups in the shards'
stead. Its optimizer's step hooks call ``before`` (full grads, and full values where stale)
and ``after`` (updated values back into the shards); a closure passed to ``step`` is wrapped
(whole/closures.py) to call ``before_closure`` (current values into the shards, so the
closure's forward sees them) and ``after_closure`` (its grads to the full tensors).
"""

from __future__ import annotations

import abc
import types
import weakref
from typing import Any, Iterable

import torch

from parts.base.owners import OwnerPlan
from parts.partition.core import disk


def size(nbytes: float) -> str:
    """``nbytes`` for a log line: "812 B", "3.1 KiB", "25.4 MiB", "1.2 GiB"."""
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def _refuse_parked(records: list, name: str, path: str) -> None:
    for m in records:
        if disk.parked_version(m.shard) is not None:
            raise RuntimeError(f"parts.partition: {name} takes the {path} path, but {m.describe()} has its "
                               f"shard in a DiskStore; keep this optimizer's parameters in memory "
                               f"(partitioned() without remote_device) or use an element-wise optimizer there")


def _install_zero_grad(optimizer: torch.optim.Optimizer, records: list) -> None:
    """``optimizer.zero_grad()`` also clears the grad shards of ``records`` (it no longer holds them)."""
    plain = optimizer.zero_grad

    def zero_grad(self_: Any, set_to_none: bool = True) -> None:
        plain(set_to_none)
        for m in records:
            grad = m.grad_shard
            if grad is not None:
                if set_to_none:
                    m.grad_shard = None
                else:
                    grad.zero_()
    optimizer.__dict__["zero_grad"] = types.MethodType(zero_grad, optimizer)


class FullStepper(abc.ABC):
    """Full-shape tensors in an optimizer's groups for sharded parameters, one process group and dtype."""

    path = ""

    def __init__(self, optimizer: torch.optim.Optimizer, records: list) -> None:
        name = type(optimizer).__name__
        self.records = sorted(records, key=lambda m: m.id)
        first = self.records[0]
        for m in self.records:
            if m.info.group is not first.info.group or m.shard.dtype != first.shard.dtype:
                raise ValueError(f"parts.partition: {name} steps {first.describe()} and {m.describe()}, sharded "
                                 f"over different process groups or in different dtypes; build one optimizer "
                                 f"per group and dtype")
        _refuse_parked(self.records, name, self.path)
        self.info, self.dtype = first.info, first.shard.dtype
        self.plan = OwnerPlan(tuple(m.numel for m in self.records),
                              tuple(m.layout.shard_numel for m in self.records), self.info.world_size)
        self.stamps: list[Any] = [None] * len(self.records)  # shard versions when the full copies were made
        self._family = [weakref.ref(optimizer)]
        self.tensors: list[torch.Tensor] = []
        self.by_record: dict[int, torch.Tensor] = {}

    def _hold(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.by_record = {id(m): t for m, t in zip(self.records, tensors)}

    def adopt(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """The optimizers that step these tensors (one, or a wrapper and the optimizers it holds):
        their ``zero_grad()`` clears the grad shards too, and their state is this stepper's to keep."""
        self._family = [weakref.ref(o) for o in optimizers]
        for o in self.optimizers():
            _install_zero_grad(o, self.records)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The live optimizers that step these tensors."""
        return [o for o in (ref() for ref in self._family) if o is not None]

    def owner_of(self, record: Any) -> int:
        """The rank whose copy of ``record``'s state is the one saved and shared."""
        return self.plan.owners[self.records.index(record)]

    def owns(self, record: Any) -> bool:
        """True if this rank is ``record``'s owner."""
        return self.owner_of(record) == self.info.rank

    def nbytes(self) -> int:
        """Bytes of the parameters' full values."""
        return sum(m.numel for m in self.records) * torch.empty(0, dtype=self.dtype).element_size()

    @abc.abstractmethod
    def before(self) -> None:
        """Give the full tensors their grads (and their values, where stale) before a step."""

    @abc.abstractmethod
    def after(self) -> None:
        """Write the updated full values into the shards and drop the full grads after a step."""

    @abc.abstractmethod
    def before_closure(self) -> None:
        """Write the current full values into the shards before a closure's forward."""

    @abc.abstractmethod
    def after_closure(self) -> None:
        """Give the full tensors the grads a closure's backward left in the grad shards."""

    @abc.abstractmethod
    def costs(self) -> str:
        """Memory per rank and bytes per step, for the log line."""
