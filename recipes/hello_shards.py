"""Shard a flat tensor over the ranks with ShardLayout and gather it back.

    torchrun --standalone --nproc-per-node 2 recipes/hello_shards.py
"""

import torch
import torch.distributed as dist

from parts._compat import all_gather_flat
from parts.partition import ShardLayout


def main() -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    full = torch.arange(15, dtype=torch.float32)
    layout = ShardLayout(full.numel(), world_size)
    start, stop = layout.range(rank)
    shard = torch.zeros(layout.shard_numel)
    shard[: stop - start] = full[start:stop]
    gathered = torch.empty(layout.padded_numel)
    all_gather_flat(gathered, shard)
    assert torch.equal(gathered[: full.numel()], full)
    print(f"rank {rank}: owns [{start}, {stop}) + {layout.padding(rank)} padding; gather ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
