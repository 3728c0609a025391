"""A/B of OffloadedOptimizer's pipeline across steps, in one run, against the in-memory system.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_offload_pipeline.py --rounds 2 --block 3
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_offload_pipeline.py --device cuda  # GPU compute

Three systems built up front as ``bench_offload.py`` builds them: in memory, offloaded with the
pipeline across steps (writes behind, reads ahead: the default) and offloaded within each step
only (``across_steps=False``), each on its own store. They run in blocks of ``--block``
consecutive steps (the steady state of a training loop), the block order rotated each round;
a block's last offloaded step settles its pipeline inside its own time, so every byte a block
moves is paid by that block. Printed per rank: medians over rounds of the per-step means of
wall, CPU (this process, IO threads included), ``optimizer.step()`` wall and IO wait.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_offload as bench  # noqa: E402
from chardata import load_splits  # noqa: E402  (recipes/ is on the path through bench_offload)
from record import record  # noqa: E402

from parts.comm import all_gather_objects  # noqa: E402
from parts.offload import DiskStore  # noqa: E402

NAMES = ("memory", "across", "within")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``args.device`` comes back resolved to ``cpu`` or ``cuda``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", choices=sorted(bench.PRESETS), default="125M")
    ap.add_argument("--store", default="/tmp/parts-bench-offload-pipeline")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--block", type=int, default=3, help="consecutive steps of one system")
    args = bench.devices.parse_with_device(ap, argv)
    args.after_backward = False  # bench_offload.step's default: the optimizer steps during backward
    return args


def run_block(system, store, tokens, gen, args) -> tuple[float, ...]:
    """Per-step means over one block: wall, CPU, optimizer-step wall, IO wait (seconds)."""
    model, opt = system
    recs = [bench.step(model, opt, tokens, gen, args, store, flush=k == args.block - 1)
            for k in range(args.block)]
    wait = [r["io"].wait_seconds for r in recs] if store is not None else [0.0]
    return tuple(sum(r[key] for r in recs) / len(recs) for key in ("wall", "cpu", "opt_wall")) + (
        sum(wait) / len(recs),)


def measure(args, stores: dict, tokens) -> dict[str, list[tuple[float, ...]]]:
    """Blocks of every system, block order rotated per round, after one warm-up step each."""
    systems, gens = [], [torch.Generator().manual_seed(dist.get_rank()) for _ in NAMES]
    for name in NAMES:
        args.within_step = name == "within"
        systems.append(bench.build(args, stores[name]))
    for system, gen, name in zip(systems, gens, NAMES):
        bench.step(*system, tokens, gen, args, stores[name])
    blocks: dict[str, list[tuple[float, ...]]] = {name: [] for name in NAMES}
    for r in range(args.rounds):
        for j in range(len(NAMES)):
            which = (r + j) % len(NAMES)
            blocks[NAMES[which]].append(run_block(systems[which], stores[NAMES[which]], tokens, gens[which], args))
    for model, _ in systems:
        bench.detach(model)
    return blocks


def report(rows: list[dict], args, loads) -> None:
    """One line per rank and system: medians over rounds, ratios to the in-memory system."""
    print(f"{args.params}, world {len(rows)}, blocks of {args.block} steps, {args.rounds} rounds; load "
          f"average at start {bench._load(loads[0])}, at end {bench._load(loads[1])}")
    table = []
    for rank, blocks in enumerate(rows):
        med = {n: [statistics.median(b[i] for b in blocks[n]) for i in range(4)] for n in NAMES}
        for name in NAMES:
            wall, cpu, opt_wall, wait = med[name]
            print(f"rank {rank} {name:7s} per step: wall {wall:.2f} s, CPU {cpu:.2f} s, optimizer.step "
                  f"{opt_wall:.2f} s, IO wait {wait:.2f} s; / memory: wall {wall / med['memory'][0]:.2f}, "
                  f"CPU {cpu / med['memory'][1]:.2f}; block walls {[round(b[0], 2) for b in blocks[name]]}")
            table.append({"rank": rank, "system": name, "step_wall_s": round(wall, 3), "step_cpu_s": round(cpu, 3),
                          "optimizer_step_s": round(opt_wall, 3), "io_wait_s": round(wait, 3),
                          "wall_vs_memory": round(wall / med["memory"][0], 3),
                          "cpu_vs_memory": round(cpu / med["memory"][1], 3)})
    record("bench_offload_pipeline" + ("_cuda" if args.device == "cuda" else ""), {"rows": table, "summary": {
        "model": args.params, "world": len(rows), "steps per block": args.block, "rounds": args.rounds}})


def main() -> None:
    args = parse_args()
    rank, _ = bench.setup(args.device)
    stores = {"memory": None, "across": DiskStore(os.path.join(args.store, f"across{rank}")),
              "within": DiskStore(os.path.join(args.store, f"within{rank}"))}
    tokens, _ = load_splits(None)
    loads = [os.getloadavg()]
    rows = all_gather_objects(measure(args, stores, tokens))
    loads.append(os.getloadavg())
    if rank == 0:
        report(rows, args, loads)
    for store in stores.values():
        if store is not None:
            store.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
