"""Flat-buffer arithmetic for BF16Optimizer: pure math, no ``torch.distributed``.

A param group's replicated parameters are packed back to back (offset of
parameter ``i`` = sum of the numels before it) into one flat buffer padded at the
end so that it splits into ``world_size`` equal partitions whose size is a
multiple of ``PARTITION_ALIGN`` elements. Rank ``r`` owns flat elements
``[r * S, (r + 1) * S)``; the optimizer steps that slice only.

Alignment: ``PARTITION_ALIGN = 32`` elements, so every partition starts at a
64-byte boundary of the bf16 buffer and a 128-byte boundary of the fp32 grad
and master buffers (a cache line, and the 512-bit vector width; accelerator
collective libraries want at least 16-byte aligned chunks). It also keeps the
all-gather and reduce-scatter chunks equal-sized, which the flat collectives
require.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from parts.base.layout import ShardLayout

PARTITION_ALIGN = 32

STEP_CHUNK = 1 << 18
"""Elements per master tensor the wrapped optimizer sees (1 MiB of fp32). torch optimizers make
~10 elementwise passes per tensor; over a chunk that fits in L2 those passes hit cache, over one
multi-MB partition they stream from DRAM (measured ~2-3x slower for AdamW on this CPU)."""


@dataclass(frozen=True)
class Piece:
    """The part ``[start, stop)`` of parameter ``index`` that lies at ``offset`` in a partition."""

    index: int
    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class GroupLayout:
    """Where each parameter of one group lives in the padded flat buffer and its partitions."""

    numels: tuple[int, ...]
    world_size: int
    align: int = PARTITION_ALIGN

    def __post_init__(self) -> None:
        if any(n < 0 for n in self.numels):
            raise ValueError(f"GroupLayout numels must be >= 0, got {self.numels}")

    @property
    def offsets(self) -> tuple[int, ...]:
        """Flat offset of every parameter (back to back, in order)."""
        out, acc = [], 0
        for n in self.numels:
            out.append(acc)
            acc += n
        return tuple(out)

    @property
    def numel(self) -> int:
        """Real (unpadded) elements of the group."""
        return sum(self.numels)

    @property
    def shard(self) -> ShardLayout:
        """The equal, aligned split of the flat buffer over ranks."""
        return ShardLayout(self.numel, self.world_size, self.align)

    @property
    def partition_numel(self) -> int:
        """Elements every rank's partition holds (real plus padding)."""
        return self.shard.shard_numel

    @property
    def padded_numel(self) -> int:
        """Elements of the padded flat buffer."""
        return self.shard.padded_numel

    def pieces(self, rank: int) -> list[Piece]:
        """The parameter pieces that intersect ``rank``'s partition, in flat order."""
        start, stop = self.shard.range(rank)
        base = rank * self.partition_numel
        out = []
        for index, (off, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(off, start), min(off + n, stop)
            if lo < hi:
                out.append(Piece(index, lo - off, hi - off, lo - base))
        return out


@dataclass(frozen=True)
class BucketPiece:
    """Elements ``[start, stop)`` of group ``group``'s partition, at ``offset`` in a bucket chunk."""

    group: int
    start: int
    stop: int
    offset: int


def plan_buckets(partition_numels: Sequence[int], max_elements: int,
                 world_size: int) -> list[list[BucketPiece]]:
    """Split all groups' partitions into all-gather buckets of at most ``max_elements`` gathered elements."""
    chunk = max_elements // world_size
    if chunk < 1:
        raise ValueError(f"allgather_bucket_size={max_elements} is smaller than the world size "
                         f"{world_size}: a bucket must hold at least one element per rank")
    buckets: list[list[BucketPiece]] = []
    current: list[BucketPiece] = []
    used = 0
    for group, total in enumerate(partition_numels):
        start = 0
        while start < total:
            if used == chunk:
                buckets.append(current)
                current, used = [], 0
            take = min(chunk - used, total - start)
            current.append(BucketPiece(group, start, start + take, used))
            used += take
            start += take
    if current:
        buckets.append(current)
    return buckets


def chunk_ranges(numel: int, chunk: int = STEP_CHUNK) -> list[tuple[int, int]]:
    """``(start, length)`` of consecutive chunks of at most ``chunk`` elements covering ``numel``."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return [(s, min(chunk, numel - s)) for s in range(0, numel, chunk)]


def source_ranges(start: int, stop: int, shard_numel: int) -> list[tuple[int, int, int]]:
    """Split flat range ``[start, stop)`` by owner: ``(rank, lo, hi)`` local to that rank's partition."""
    if shard_numel < 1:
        raise ValueError(f"shard_numel must be >= 1, got {shard_numel}")
    out = []
    pos = start
    while pos < stop:
        rank = pos // shard_numel
        end = min(stop, (rank + 1) * shard_numel)
        out.append((rank, pos - rank * shard_numel, end - rank * shard_numel))
        pos = end
    return out


def counted_ranges(pieces: Sequence[Piece], counted: Sequence[bool]) -> list[tuple[int, int]]:
    """``(offset, length)`` runs of a partition whose parameters count toward the grad norm.

    ``pieces`` are one rank's partition pieces (:meth:`GroupLayout.pieces`); ``counted[i]`` says
    whether parameter ``i`` counts on this rank. Adjacent counted pieces merge into one run.
    """
    out: list[tuple[int, int]] = []
    for pc in pieces:
        if not counted[pc.index]:
            continue
        length = pc.stop - pc.start
        if out and out[-1][0] + out[-1][1] == pc.offset:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((pc.offset, length))
    return out
