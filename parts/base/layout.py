"""Shard layout: how a flat tensor of ``numel`` elements is split over ranks.

Pure arithmetic, no ``torch.distributed``: every rank owns ``shard_numel``
consecutive elements of the flat tensor padded to ``padded_numel``; the last
ranks may own padding only. Used for parameters, gradients and optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardLayout:
    """Split of ``numel`` elements over ``world_size`` ranks in chunks that are multiples of ``align``."""

    numel: int
    world_size: int
    align: int = 1

    def __post_init__(self) -> None:
        for name in ("numel", "world_size", "align"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"ShardLayout.{name} must be an int, got {type(value).__name__}")
        if self.numel < 0:
            raise ValueError(f"ShardLayout.numel must be >= 0, got {self.numel}")
        if self.world_size < 1:
            raise ValueError(f"ShardLayout.world_size must be >= 1, got {self.world_size}")
        if self.align < 1:
            raise ValueError(f"ShardLayout.align must be >= 1, got {self.align}")

    @property
    def shard_numel(self) -> int:
        """Elements every rank stores (real plus padding), a multiple of ``align``."""
        per_rank = -(-self.numel // self.world_size)
        return -(-per_rank // self.align) * self.align

    @property
    def padded_numel(self) -> int:
        """Elements of the padded flat tensor: ``shard_numel * world_size``."""
        return self.shard_numel * self.world_size

    def range(self, rank: int) -> tuple[int, int]:
        """``(start, stop)`` of the real (unpadded) elements ``rank`` owns, in flat coordinates."""
        self._check_rank(rank)
        start = min(rank * self.shard_numel, self.numel)
        stop = min(start + self.shard_numel, self.numel)
        return start, stop

    def padding(self, rank: int) -> int:
        """Padding elements at the end of ``rank``'s shard."""
        start, stop = self.range(rank)
        return self.shard_numel - (stop - start)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size}) for {self}")
