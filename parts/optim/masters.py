"""What the state-dict modules read of ``BF16Optimizer``: its groups of fp32 master partitions.

A structural type, so ``state_dict``, ``dcp_state`` and ``offloaded`` depend on what they use,
not on the optimizer module that imports them.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from parts.comm import GroupInfo

from .flat_group import FlatGroup
from .loss_scaler import DynamicLossScaler
from .sharded import ShardedParam


class Masters(Protocol):
    """An optimizer over fp32 masters: flat groups of replicated params, sharded params' shards."""

    optimizer: torch.optim.Optimizer
    comm: GroupInfo
    rank: int
    world_size: int
    flat_groups: list[Optional[FlatGroup]]
    sharded_groups: list[list[ShardedParam]]
    loss_scaler: Optional[DynamicLossScaler]
    skipped_steps: int

    def locate(self, p: torch.Tensor) -> tuple[str, int, int]:
        """Where ``p`` lives: ``("flat" | "sharded", group, index)``."""
        ...

    def sync_masters(self) -> list[str]:
        """Bring the masters up to date with the params; the names of the params that changed."""
        ...

    def write_back(self) -> None:
        """Cast the masters into the params."""
        ...
