"""Which rank steps which whole tensor, and the split sizes of the exchanges that serve it.

A shape-aware optimizer (Adafactor, Muon, a per-tensor trust ratio) needs each parameter whole.
``OwnerPlan`` gives every such parameter one owner rank, balanced by size: the largest first, each
to the least loaded rank so far (ties to the lower rank), so no rank holds more than the mean
load plus the largest tensor. The exchanges are all-to-alls over the shard group: shard
holders send their pieces of parameter ``j`` to ``owner(j)`` (in plan order, grouped by
destination), and owners send each holder its piece of the updated tensor back. Pure
arithmetic: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union


def assign_owners(sizes: tuple[int, ...], world_size: int) -> tuple[int, ...]:
    """The owner rank of each tensor of ``sizes`` elements: largest first to the least loaded rank."""
    if world_size < 1:
        raise ValueError(f"assign_owners: world_size must be at least 1, got {world_size}")
    loads = [0] * world_size
    owners = [0] * len(sizes)
    for j in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[j] = rank
        loads[rank] += sizes[j]
    return tuple(owners)


@dataclass(frozen=True)
class OwnerPlan:
    """Owners of whole tensors (``sizes`` elements, ``shard_numels`` per rank) over ``world_size`` ranks."""

    sizes: tuple[int, ...]
    shard_numels: tuple[int, ...]
    world_size: int
    owners: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.shard_numels):
            raise ValueError("OwnerPlan: sizes and shard_numels differ in length")
        for size, shard in zip(self.sizes, self.shard_numels):
            if shard * self.world_size < size:
                raise ValueError(f"OwnerPlan: {self.world_size} shards of {shard} cannot hold {size} elements")
        object.__setattr__(self, "owners", assign_owners(self.sizes, self.world_size))

    def owned(self, rank: int) -> tuple[int, ...]:
        """Indices of the tensors ``rank`` owns, in plan order."""
        return tuple(j for j, o in enumerate(self.owners) if o == rank)

    def load(self, rank: int) -> int:
        """Elements ``rank`` owns."""
        return sum(self.sizes[j] for j in self.owned(rank))

    def to_owners(self, rank: int, pieces: Union[int, Sequence[int]] = 1) -> tuple[list[int], list[int]]:
        """(send, receive) split sizes of ``rank`` in the exchange to the owners: ``pieces`` tensors of
        one shard per parameter (a grad, and its values where the owner's copy is stale: 2), one
        count for all or one per parameter."""
        counts = [pieces] * len(self.sizes) if isinstance(pieces, int) else list(pieces)
        per = [counts[j] * self.shard_numels[j] for j in range(len(self.sizes))]
        send = [sum(per[j] for j in self.owned(d)) for d in range(self.world_size)]
        return send, [send[rank]] * self.world_size

    def from_owners(self, rank: int) -> tuple[list[int], list[int]]:
        """(send, receive) split sizes of ``rank`` in the exchange back from the owners (one value shard each)."""
        receive, send = self.to_owners(rank)
        return send, receive
