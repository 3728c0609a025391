"""Checkpoint save + load: sharded DCP (every rank its own shard) vs full_state_dict + parts.io.

    python benchmarks/bench_checkpoint_dcp.py                              # 25.4M-param GPT, world 2
    python benchmarks/bench_checkpoint_dcp.py --model 1b --rounds 1        # 1.0B params, shards on disk
    python benchmarks/bench_checkpoint_dcp.py --device cuda   # shards on one GPU per rank, NCCL; records ..._cuda

The GPT of recipes/gpt_model.py is built under ``partitioned()`` (fp32 shards, no rank ever
holds the whole model) in fresh ``--world-size`` gloo processes; with ``--disk`` (implied by
``--model 1b``: 20 layers x 2048) under ``partitioned(remote_device=DiskStore(...))``, every
shard in a scratch store on disk, as recipes/train_offload.py builds. Then, model weights
only, each method saves and loads back ``--rounds`` times (the last round is reported; with
2, the first warms imports and thread pools): **dcp** = ``sharded_state_dict`` + ``parts.comm.dcp.save`` / ``load`` +
``load_sharded_state_dict``; **full** = ``full_state_dict`` (gathers on rank 0) +
``parts.io.save`` on rank 0 / ``parts.io.load`` on rank 0 + ``load_full_state_dict``.
Per rank: wall time, CPU time (user + sys of the process, load-independent) and RSS growth
over the RSS before the operation (sampled every millisecond). Loads are checked bitwise
against the saved weights (a fingerprint per shard, read one shard at a time on disk).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import devices  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402
from record import record  # noqa: E402


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(fn) -> dict:
    """Wall s, CPU s and peak RSS growth (bytes) of ``fn()`` on this rank, after a barrier."""
    dist.barrier()
    base, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    wall, cpu = time.perf_counter(), _cpu()
    try:
        fn()
        dist.barrier()
    finally:
        done.set()
        sampler.join()
    return {"wall": time.perf_counter() - wall, "cpu": _cpu() - cpu, "rss": max(peak[0], _rss()) - base}


def dcp_ops(model, path: str) -> tuple:
    """(save, load) through DCP, every rank its own shard."""
    from parts.comm import dcp
    from parts.partition import load_sharded_state_dict, sharded_state_dict

    def save() -> None:
        dcp.save({"model": sharded_state_dict(model)}, checkpoint_id=path)

    def load() -> None:
        state = {"model": sharded_state_dict(model)}
        dcp.load(state, checkpoint_id=path)
        load_sharded_state_dict(model, state["model"])
    return save, load


def full_ops(model, path: str) -> tuple:
    """(save, load) of one consolidated file on rank 0."""
    from parts import io as pio
    from parts.partition import full_state_dict, load_full_state_dict

    def save() -> None:
        state = full_state_dict(model)
        if dist.get_rank() == 0:
            pio.save(state, path)
        del state

    def load() -> None:
        state = pio.load(path) if dist.get_rank() == 0 else {}
        load_full_state_dict(model, state)
        del state
    return save, load


def _fingerprints(model) -> list[tuple[int, int]]:
    """Per shard: (sum, position-weighted sum) of its bits as int32, one shard in memory at a time."""
    from parts.partition import meta
    from parts.partition.core import disk
    out = []
    for p in model.parameters():
        with disk.peek(meta(p).shard):
            bits = meta(p).shard.view(torch.int32).to(torch.int64)
            place = torch.arange(bits.numel(), device=bits.device)
            out.append((int(bits.sum()), int((bits * place % 1_000_003).sum())))
    return out


def _perturb(model) -> None:
    """Add 1 to every shard (the load must bring the saved values back)."""
    from parts.partition import meta
    from parts.partition.core import disk
    with torch.no_grad():
        for p in model.parameters():
            with disk.rewrite(meta(p).shard):
                meta(p).shard.add_(1.0)


def _build(config: GPTConfig, disk_dir: str, rank: int, device: torch.device):
    """The GPT under partitioned() on ``device``, its shards in a DiskStore under ``disk_dir`` if given."""
    from parts.offload import DiskStore
    from parts.partition import partitioned
    store = DiskStore(os.path.join(disk_dir, f"rank{rank}")) if disk_dir else None
    torch.manual_seed(0)
    with partitioned(device=device, remote_device=store):
        return GPT(config), store


def _worker(rank: int, world: int, port: int, config: GPTConfig, scratch: str, results: dict,
            disk_dir: str, methods: list, rounds: int, device: str) -> None:
    torch.set_num_threads(1)
    where = devices.init_spawned(device, rank, world, port)  # gloo, or NCCL on GPU ``rank``
    from parts.observe import set_mmap_threshold
    set_mmap_threshold(1 << 20)  # freed buffers leave RSS at once: growth is what is held
    started = time.perf_counter()
    model, store = _build(config, disk_dir, rank, where)
    if rank == 0:
        print(f"built in {time.perf_counter() - started:.0f} s, RSS {_rss() / 2**20:.0f} MiB", flush=True)
    expected = _fingerprints(model)
    rows = {}
    for method in methods:
        ops = {"dcp": dcp_ops, "full": full_ops}[method]
        for attempt in range(rounds):
            path = os.path.join(scratch, f"{method}-{attempt}")
            save, load = ops(model, path)
            saved = measure(save)
            _perturb(model)
            rows[method] = (saved, measure(load))
            if _fingerprints(model) != expected:
                raise RuntimeError(f"{method}: load did not restore the saved weights on rank {rank}")
            if rank == 0:
                print(f"{method} round {attempt + 1} done", flush=True)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
    results[rank] = rows
    if store is not None:
        store.close()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``args.device`` comes back resolved to ``cpu`` or ``cuda``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", choices=("25m", "1b"), default="25m",
                        help="25m: 8 x 512 in memory; 1b: 20 x 2048 with its shards on disk (--disk)")
    parser.add_argument("--n-embd", type=int, default=None)
    parser.add_argument("--n-layer", type=int, default=None)
    parser.add_argument("--disk", action="store_true", help="shards in a DiskStore (remote_device)")
    parser.add_argument("--methods", default="dcp,full", help="comma-separated: dcp, full")
    parser.add_argument("--rounds", type=int, default=2, help="save+load rounds per method; the last is reported")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    return devices.parse_with_device(parser, argv)


def main() -> None:
    """Save and load with each method in fresh ranks, print and record the table."""
    args = parse_args()
    big = args.model == "1b"
    args.n_layer = args.n_layer or (20 if big else 8)
    args.n_embd = args.n_embd or (2048 if big else 512)
    args.disk = args.disk or big
    config = GPTConfig(vocab_size=128, block_size=128, n_layer=args.n_layer, n_head=8, n_embd=args.n_embd)
    params = 12 * args.n_layer * args.n_embd ** 2 + 13 * args.n_layer * args.n_embd + 256 * args.n_embd
    print(f"GPT ~{params / 1e6:.1f}M params ({params * 4 / 2**20:,.0f} MiB fp32), world {args.world_size}, "
          f"shards {'on disk' if args.disk else 'in memory'}, compute on {args.device}")
    scratch = args.dir or tempfile.mkdtemp(prefix="bench-dcp-")
    os.makedirs(scratch, exist_ok=True)
    disk_dir = os.path.join(scratch, "store") if args.disk else ""
    methods = args.methods.split(",")
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(args.world_size, _free_port(), config, scratch, results, disk_dir, methods, args.rounds,
                            args.device),
             nprocs=args.world_size)
    heads = "  ".join(f"rank {r}: wall s / CPU s / RSS +MiB" for r in range(args.world_size))
    print(f"\n{'method':<6} {'op':<5} " + heads)
    for method in methods:
        for op, index in (("save", 0), ("load", 1)):
            cells = [results[r][method][index] for r in range(args.world_size)]
            print(f"{method:<6} {op:<5} " + "  ".join(
                f"{c['wall']:>13.2f} / {c['cpu']:>5.2f} / {c['rss'] / 2**20:>8.1f}" for c in cells))
    record("bench_checkpoint_dcp" + ("_cuda" if args.device == "cuda" else ""), {"rows": [
        {"method": method, "op": op, "rank": r, "wall_s": round(results[r][method][i]["wall"], 3),
         "cpu_s": round(results[r][method][i]["cpu"], 3),
         "rss_growth_MiB": round(results[r][method][i]["rss"] / 2**20, 1)}
        for method in methods for op, i in (("save", 0), ("load", 1)) for r in range(args.world_size)],
        "summary": {"params (M)": round(params / 1e6, 1), "world": args.world_size,
                    "shards": "on disk" if args.disk else "in memory"}})
    if not args.dir:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
