"""A fake world for planning: torch's fake process group, where every collective returns at once.

``fake_world(world_size)`` makes this process rank ``rank`` of a world of ``world_size``
ranks that do not exist: collectives move nothing and take no time (an all-gather leaves
its output as it is), so a model built on the meta device can be attached, run and stepped
at any world size to read what each rank would hold and send. Only for dry runs: values
are meaningless. Refuses to replace a process group that is already initialised.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Run the body as ``rank`` of a fake ``world_size``-rank default process group."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"fake_world: need world_size >= 1 and 0 <= rank < world_size, "
                         f"got world_size={world_size}, rank={rank}")
    if dist.is_initialized():
        raise RuntimeError("fake_world: torch.distributed is already initialised; a dry run needs "
                           "a process of its own (it replaces the default process group)")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's own test store

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def block_layout(shard_size: int) -> tuple:
    """``(shard_group, replica_group)`` of this rank in the (replicate, shard) layout of the world:
    shard groups are blocks of ``shard_size`` consecutive ranks (a node's ranks, as torchrun
    numbers them), replica groups take one rank of each block. Every rank must call it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if shard_size < 1 or world % shard_size:
        raise ValueError(f"block_layout: shard_size {shard_size} does not divide the world size {world}")
    mine = {}
    for start in range(0, world, shard_size):  # every group in the same order on every rank
        group = dist.new_group(list(range(start, start + shard_size)))
        if start <= rank < start + shard_size:
            mine["shard"] = group
    for offset in range(shard_size):
        group = dist.new_group(list(range(offset, world, shard_size)))
        if rank % shard_size == offset:
            mine["replica"] = group
    return mine["shard"], mine["replica"]
