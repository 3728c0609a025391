"""Pure arithmetic of the data-parallel x tensor-parallel grid and of tensor-parallel slices.

No ``torch`` and no ``torch.distributed``: which ranks form which group, where a rank sits
in the grid, and which rows of a full weight a tensor-parallel rank owns.
"""

from __future__ import annotations

from dataclasses import dataclass


def _check_int(owner: str, name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class GridLayout:
    """``world_size`` ranks as ``dp_size`` rows of ``tp`` consecutive ranks (positions 0..world_size-1)."""

    world_size: int
    tp: int

    def __post_init__(self) -> None:
        _check_int("GridLayout", "world_size", self.world_size, 1)
        _check_int("GridLayout", "tp", self.tp, 1)
        if self.world_size % self.tp:
            raise ValueError(f"world size {self.world_size} is not divisible by tp={self.tp}: "
                             f"cannot split it into a data-parallel x tensor-parallel grid")

    @property
    def dp(self) -> int:
        """Number of data-parallel replicas (rows of the grid)."""
        return self.world_size // self.tp

    def coords(self, position: int) -> tuple[int, int]:
        """``(dp_rank, tp_rank)`` of the rank at ``position`` in the (sub)world."""
        self._check(position)
        return position // self.tp, position % self.tp

    def position(self, dp_rank: int, tp_rank: int) -> int:
        """Position in the (sub)world of grid cell ``(dp_rank, tp_rank)``."""
        if not (0 <= dp_rank < self.dp and 0 <= tp_rank < self.tp):
            raise ValueError(f"grid cell ({dp_rank}, {tp_rank}) is outside {self.dp} x {self.tp}")
        return dp_rank * self.tp + tp_rank

    def tp_groups(self) -> list[list[int]]:
        """Positions of every tensor-parallel group (consecutive ranks), in creation order."""
        return [list(range(d * self.tp, (d + 1) * self.tp)) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        """Positions of every data-parallel group (stride ``tp``), in creation order."""
        return [list(range(t, self.world_size, self.tp)) for t in range(self.tp)]

    def _check(self, position: int) -> None:
        if not 0 <= position < self.world_size:
            raise ValueError(f"rank position {position} is outside [0, {self.world_size})")


def tp_ranges(size: int, tp_size: int, tp_rank: int, chunks: int = 1) -> list[tuple[int, int]]:
    """``(start, stop)`` ranges of a dimension of ``size`` that ``tp_rank`` owns.

    The dimension is ``chunks`` equal blocks (e.g. q, k, v of a fused projection); each block
    is split evenly over the ``tp_size`` ranks, so a rank owns one piece of every block.
    """
    _check_int("tp_ranges", "size", size, 0)
    _check_int("tp_ranges", "tp_size", tp_size, 1)
    _check_int("tp_ranges", "chunks", chunks, 1)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside [0, {tp_size})")
    if size % (chunks * tp_size):
        raise ValueError(f"a dimension of size {size} in {chunks} chunk(s) cannot be split evenly "
                         f"over tp_size={tp_size} ranks")
    block, piece = size // chunks, size // (chunks * tp_size)
    return [(c * block + tp_rank * piece, c * block + (tp_rank + 1) * piece) for c in range(chunks)]
