"""Parameters that parts.partition already shards: an fp32 master of this rank's shard."""

from __future__ import annotations

from typing import Any, Optional

import torch

from parts.partition.core import disk
from parts.partition.core.param import ParamMeta
from parts.partition.core.steps import watch as watch_steps


class ShardedParam:
    """A sharded parameter: steps an fp32 copy of ``meta.shard`` with ``meta.grad_shard`` as its grad."""

    def __init__(self, param: torch.nn.Parameter, record: ParamMeta, rank: int) -> None:
        self.param, self.record = param, record
        self.name = str(getattr(record, "name", "") or "")
        self.layout = record.layout
        self.shape = tuple(record.shape)
        self.numel = int(record.numel)
        self.rank = int(getattr(record, "rank", rank))
        if record.shard.dim() != 1 or record.shard.numel() != self.layout.shard_numel:
            raise ValueError(f"sharded parameter {self.name!r}: shard has {record.shard.numel()} "
                             f"elements on rank {rank}, its layout says {self.layout.shard_numel}")
        with disk.peek(record.shard):  # a shard on disk is read in for the copy
            self.master = record.shard.detach().to(torch.float32).clone()
        watch_steps(self.master, record)  # stepped in the shard's stead: its steps count on the record
        self.offloaded = False  # the master lives in the shard's DiskStore (``offload``)
        self.version = self._version()

    def offload(self, key: str) -> None:
        """Move the master to the store of its (parked) shard, under ``key``."""
        disk.park_master(self.master, self.record.shard, key)
        self.offloaded = True

    def _version(self) -> tuple:
        """Identity, version counter and storage of the shard: anything that writes it changes this
        (for a shard on disk: the saves of its bytes)."""
        shard = self.record.shard
        saved = disk.parked_version(shard)
        if saved is not None:
            return id(shard), "disk", saved
        return id(shard), shard._version, shard.data_ptr()

    def refresh_master(self) -> bool:
        """Re-read the master if the shard was written since the last write-back (e.g. by
        ``load_full_state_dict``), so a stale master never overwrites loaded weights."""
        if self._version() == self.version:
            return False
        shard = self.record.shard
        if shard.dim() != 1 or shard.numel() != self.master.numel():
            raise RuntimeError(f"BF16Optimizer: the shard of sharded parameter {self.name!r} was "
                               f"replaced by one of {shard.numel()} elements (expected "
                               f"{self.master.numel()}); rebuild the optimizer")
        with disk.peek(shard), disk.rewrite(self.master):
            self.master.copy_(shard)
        self.version = self._version()
        return True

    def peek_master(self) -> Any:
        """Context manager: inside, the master holds its bytes (an offloaded one is read in, then dropped)."""
        return disk.peek(self.master)

    def set_master(self, values: torch.Tensor) -> None:
        """Make ``values`` (fp32, this rank's shard, zero padding) the master; an offloaded master
        is written to the store and into its model-dtype shard there (neither is read first)."""
        if not self.offloaded:
            self.master.copy_(values)  # (the shard follows at the optimizer's write_back)
            return
        disk.overwrite(self.master, values)
        disk.overwrite(self.record.shard, values)
        self.version = self._version()

    def real_numel(self) -> int:
        """Real (unpadded) elements of this rank's shard."""
        start, stop = self.layout.range(self.rank)
        return stop - start

    def grad(self) -> Optional[torch.Tensor]:
        """The averaged fp32 grad shard the coordinator produced, checked, or None."""
        g = getattr(self.record, "grad_shard", None)
        if g is None:  # (a shard on disk has its grad in the store: ``stored_grad``)
            return None
        if g.numel() != self.master.numel():
            raise ValueError(f"sharded parameter {self.name!r}: grad shard has {g.numel()} "
                             f"elements on rank {self.rank}, expected {self.master.numel()}")
        return g.view(-1) if g.dtype == torch.float32 else g.view(-1).to(torch.float32)

    def has_grad(self) -> bool:
        """True if a grad shard is waiting, in memory or (shard on disk) in the store."""
        return self.grad() is not None or disk.has_grad(self.record.shard)

    def any_grad(self) -> Optional[torch.Tensor]:
        """The fp32 grad shard (padded), in memory or read from the store; None if there is none."""
        g = self.grad()
        if g is None and disk.has_grad(self.record.shard):
            g = disk.read_grad(self.record.shard).view(-1).to(torch.float32)
        return g

    def stored_grad(self) -> torch.Tensor:
        """The fp32 grad of a shard on disk, read from the store (its real elements)."""
        return disk.read_grad(self.record.shard).view(-1).to(torch.float32).narrow(0, 0, self.real_numel())

    def write_back(self) -> None:
        """Zero the master's padding and copy it into the model-dtype shard in place."""
        with disk.rewrite(self.master):  # an offloaded master is read in (and saved back)
            self.write_back_loaded()

    def write_back_loaded(self) -> None:
        """``write_back`` with the master's bytes present (inside ``OffloadedOptimizer.step``)."""
        real = self.real_numel()
        if real < self.master.numel():
            self.master.narrow(0, real, self.master.numel() - real).zero_()
        if disk.parked_version(self.record.shard) is not None:
            disk.overwrite(self.record.shard, self.master)
        else:
            with torch.no_grad():  # a trainable parameter's shard requires grad, as the parameter
                self.record.shard.copy_(self.master)
        self.version = self._version()

    def zero_grad(self, set_to_none: bool) -> None:
        """Drop (or zero) the grad shard."""
        disk.clear_grad(self.record.shard)
        g = getattr(self.record, "grad_shard", None)
        if g is None:
            return
        if set_to_none:
            try:
                self.record.grad_shard = None
                return
            except (AttributeError, TypeError):
                pass
        g.zero_()
