"""One rank of the emulated-cluster benchmark (launched by cluster.py through torchrun).

Trains the 25M GPT of bench_zero3.py with one system for ``--steps`` steps on the same
batches as bench_zero3 (fp32, AdamW) and, on global rank 0, writes to ``--out``: the median
step time and its phases (forward, backward, optimizer step) over the steps after the first,
the CPU seconds per step (mean over ranks, every thread), the bytes this node's end of the link
sent and received per step (the same steps: no setup), the final loss (mean over ranks), peak
RSS and parts' byte ledger per group. With ``CLUSTER_PROFILE=<path>`` in the environment each
rank also writes a cProfile of those steps to ``<path>.<system>.<rank>``."""

from __future__ import annotations

import argparse
import cProfile
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


def _node_group():
    """This node's ranks as a process group (every rank makes every node's group)."""
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    groups = [dist.new_group(list(range(start, start + local))) for start in range(0, dist.get_world_size(), local)]
    return groups[dist.get_rank() // local]


def build_fsdp2_hsdp_keep(config):
    """FSDP2 HSDP that keeps each block's params gathered from forward to backward
    (``reshard_after_forward=False``: ZeRO-2 inside the node)."""
    from torch.distributed.fsdp import fully_shard
    mesh = _mesh()
    model = GPT(config)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4), None


def build_parts_hybrid(config, **knobs):
    """parts with a hybrid layout on the same mesh; no knobs: every default (the cross-replica
    mean overlaps each backward; replicas built from one seed skip the setup broadcast). The
    variants pass ``attach`` knobs: ``secondary_group`` (node-local backward gathers: the shard
    group is the node here, they change nothing), ``compression``, a reuse distance spanning the
    model (``_keep``: FSDP2's ``reshard_after_forward=False``), bench_zero3's ``persistence_threshold=0``."""
    from parts.partition import attach, partitioned, shards
    with partitioned(mesh=_mesh()):
        model = GPT(config)
    coordinator = attach(model, **knobs)
    return model, torch.optim.AdamW(shards(model), lr=3e-4), coordinator


def build_parts_full(config, two_hop=False, secondary=None, compression=None):
    """parts full sharding with the knobs of bench_zero3's ``parts``; ``two_hop``: all-gathers
    and reduce-scatters that know the nodes (``ranks_per_node``); ``secondary``: node-local
    backward gathers (``attach(secondary_group=)``, ZeRO++ hpZ); ``compression``: a policy."""
    from parts.partition import attach, partitioned, shards
    with partitioned(ranks_per_node=int(os.environ["LOCAL_WORLD_SIZE"]) if two_hop else 1):  # 1: flat
        model = GPT(config)
    coordinator = attach(model, persistence_threshold=0, secondary_group=secondary, compression=compression)
    return model, torch.optim.AdamW(shards(model), lr=3e-4), coordinator


def _step_sync(model, optimizer, coordinator):
    """The cross-replica mean once, at the optimizer step (``set_replica_sync(model, "step")``)."""
    from parts.partition import set_replica_sync
    set_replica_sync(coordinator, "step")
    return model, optimizer, coordinator


def _slow_link(**codes):
    """Int8 codes on the collectives that cross between the nodes only."""
    from parts.partition import Compression
    return Compression(on="replicas", **codes)


def _cpu_seconds() -> float:
    """CPU seconds (user + system, every thread) this process used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _gathered_mean(value: float) -> float:
    """The mean over ranks of ``value``."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _link_bytes() -> list[int]:
    """Bytes this node's end of the link (``GLOO_SOCKET_IFNAME``) sent and received so far."""
    stats = Path("/sys/class/net") / os.environ["GLOO_SOCKET_IFNAME"] / "statistics"
    return [int((stats / f"{kind}_bytes").read_text()) for kind in ("tx", "rx")]


BUILDERS = {"ddp": z.build_ddp, "fsdp2": z.build_fsdp2, "fsdp2_hsdp": build_fsdp2_hsdp,
            "parts": build_parts_full, "parts_topo": lambda c: build_parts_full(c, two_hop=True),
            "parts_hpz": lambda c: build_parts_full(c, secondary=_node_group()),
            "parts_topo_hpz": lambda c: build_parts_full(c, two_hop=True, secondary=_node_group()),
            "parts_hybrid": build_parts_hybrid,
            "parts_hybrid_step": lambda c: _step_sync(*build_parts_hybrid(c)),
            "parts_hybrid_p0": lambda c: build_parts_hybrid(c, persistence_threshold=0),
            "parts_hybrid_keep": lambda c: build_parts_hybrid(c, persistence_threshold=0, max_reuse_distance=1 << 40),
            "fsdp2_hsdp_keep": build_fsdp2_hsdp_keep,
            "parts_hybrid_hpz": lambda c: build_parts_hybrid(c, persistence_threshold=0, secondary_group=_node_group()),
            "parts_hybrid_g8": lambda c: build_parts_hybrid(c, persistence_threshold=0,
                                                            compression=_slow_link(grads="int8")),
            "parts_topo_w8g8": lambda c: build_parts_full(c, two_hop=True,
                                                          compression=_slow_link(weights="int8", grads="int8"))}


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
    phases, loss, link = [], None, None
    profiler = cProfile.Profile() if os.environ.get("CLUSTER_PROFILE") else None
    for k, (inputs, targets) in enumerate(z._batches(config, args, rank)):
        if k == 1:  # the steps after the first: link bytes per step without setup and warm-up
            dist.barrier()
            link, cpu = _link_bytes(), _cpu_seconds()
        if k == 1 and profiler is not None:
            profiler.enable()
        marks = [time.perf_counter()]
        loss = model(inputs, targets)
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        phases.append([b - a for a, b in zip(marks, marks[1:])])
    cpu = (_cpu_seconds() - cpu) / max(len(phases) - 1, 1) if link is not None else None
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(f"{os.environ['CLUSTER_PROFILE']}.{args.system}.{rank}")
    dist.barrier()
    if link is not None:
        link = [(b - a) / (len(phases) - 1) for a, b in zip(link, _link_bytes())]
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    from parts.comm.counter import ledger_since
    timed = phases[1:] or phases
    row = dict(step=statistics.median(sum(p) for p in timed),
               phases={name: statistics.median(p[i] for p in timed)
                       for i, name in enumerate(("forward", "backward", "optimizer"))},
               link_per_step=link, cpu_per_step=_gathered_mean(cpu), loss=loss.item() / world,
               peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               ledger=ledger_since(ledger_before, comm_counter.by_group()))
    if rank == 0:
        Path(args.out).write_text(json.dumps(row))
    del model, optimizer, coordinator
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
