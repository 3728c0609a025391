"""One rank of the emulated-cluster benchmark (launched by cluster.py through torchrun).

Trains the 25M GPT of bench_zero3.py with one system for ``--steps`` steps on the same
batches as bench_zero3 (fp32, AdamW) and, on global rank 0, writes the median step time,
the final loss (mean over ranks), peak RSS and parts' byte ledger per group to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent.parent / "recipes"))
import bench_zero3 as z  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402


def _mesh():
    """(replicate, shard): one replica per node, shards within the node (LOCAL_WORLD_SIZE ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    return init_device_mesh("cpu", (dist.get_world_size() // local, local), mesh_dim_names=("replicate", "shard"))


def build_fsdp2_hsdp(config):
    """FSDP2 with a 2-D mesh: HSDP (shard within the node, replicate across)."""
    from torch.distributed.fsdp import fully_shard
    mesh = _mesh()
    model = GPT(config)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4), None


def build_parts_hybrid(config):
    """parts with a hybrid layout on the same mesh, the knobs of bench_zero3's ``parts``; no
    gradient accumulation here, so the cross-replica mean overlaps each backward."""
    from parts.partition import attach, partitioned, set_replica_sync, shards
    with partitioned(mesh=_mesh()):
        model = GPT(config)
    coordinator = attach(model, persistence_threshold=0)
    set_replica_sync(coordinator, "backward")
    return model, torch.optim.AdamW(shards(model), lr=3e-4), coordinator


def build_parts_topo(config):
    """parts full sharding whose all-gathers know the nodes (two hops, ``ranks_per_node``)."""
    from parts.partition import attach, partitioned, shards
    with partitioned(ranks_per_node=int(os.environ["LOCAL_WORLD_SIZE"])):
        model = GPT(config)
    coordinator = attach(model, persistence_threshold=0)
    return model, torch.optim.AdamW(shards(model), lr=3e-4), coordinator


BUILDERS = {"ddp": z.build_ddp, "fsdp2": z.build_fsdp2, "fsdp2_hsdp": build_fsdp2_hsdp,
            "parts": z.build_parts, "parts_topo": build_parts_topo, "parts_hybrid": build_parts_hybrid}


def main() -> None:
    """Train one system, write rank 0's row as JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", choices=sorted(BUILDERS), required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    args.dtype = "fp32"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    shape = z.MODELS["25m"]
    config = GPTConfig(vocab_size=128, block_size=shape["seq"], n_layer=shape["n_layer"],
                       n_embd=shape["n_embd"], n_head=shape["n_head"])
    torch.manual_seed(0)
    model, optimizer, coordinator = BUILDERS[args.system](config)
    from parts.comm import comm_counter
    ledger_before = comm_counter.by_group()
    times, loss = [], None
    for inputs, targets in z._batches(config, args, rank):
        started = time.perf_counter()
        loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    from parts.comm.counter import ledger_since
    row = dict(step=statistics.median(times[1:] or times), loss=loss.item() / world,
               peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               ledger=ledger_since(ledger_before, comm_counter.by_group()))
    if rank == 0:
        Path(args.out).write_text(json.dumps(row))
    del model, optimizer, coordinator
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
