"""Benchmark parts.offload beside DeepSpeed ZeRO-Infinity: the same GPT, data and steps, with
parameters and AdamW state on disk in both.

    python benchmarks/bench_offload_infinity.py                   # 25M GPT, world 2
    python benchmarks/bench_offload_infinity.py --params 151M --steps 3
    python benchmarks/bench_offload_infinity.py --device cuda    # GPU compute, NCCL, DS_ACCELERATOR=cuda

Each system runs in its own ``--world-size`` processes (gloo), one system after the other, in
each of ``--rounds`` rounds (a system's step is its median over the rounds, each round's given):

* parts: ``partitioned(remote_device=DiskStore(...))``, ``attach``, ``OffloadedOptimizer(AdamW)``
  stepping during backward; the store's windows sized by its default ``memory_budget``.
* ZeRO-Infinity (DeepSpeed, ``DS_ACCELERATOR`` = the ``--device``, ``cpu`` by default): ZeRO-3
  with ``offload_param`` and ``offload_optimizer`` on ``nvme`` (a temporary directory on the same
  disk), its async IO (libaio) and CPU AdamW, every other knob at its default.

Both start from the same weights (``torch.manual_seed(0)``, rank 0's broadcast), see the same
batches (``chardata``, seeded per rank) and use AdamW with the same lr and no weight decay. Per
system: the median step time after ``--warmup`` steps, the peak RSS per rank (``ru_maxrss``), the
bytes the process read and wrote per step at the block layer (``/proc/self/io``: what reached
the disk, all threads), the CPU seconds per step per rank (user + system, all threads: what the
step costs the machine, less sensitive to other load than wall time), the minor page faults per
step per rank (each a fresh page the process touched), the fraction of the
disk's raw bandwidth that traffic is (both ranks' bytes at the ``O_DIRECT`` read and write
rates measured first, over the step time), the system load while it ran, and the loss of
every step (mean over ranks).
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import devices  # noqa: E402
from chardata import VOCAB_SIZE, batch, load_splits  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402
from record import record  # noqa: E402
from train_offload import PRESETS, count_params  # noqa: E402

LR = 1e-4
MiB = 2**20
SIZES = {**PRESETS, "151M": (12, 1024, 16)}  # the recipe's sizes, and 12 x 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``args.device`` comes back resolved to ``cpu`` or ``cuda``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", choices=sorted(SIZES), default="25M")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="measured steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--systems", default="parts,infinity,memory",
                    help="memory: parts in memory, the reference both offloaded runs' losses are set against")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary stores go")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the systems this many times, one after the other in each round; a "
                         "system's step is its median over the rounds (each round's is reported)")
    return devices.parse_with_device(ap, argv)


def config_of(args: argparse.Namespace) -> GPTConfig:
    layers, width, heads = SIZES[args.params]
    return GPTConfig(vocab_size=VOCAB_SIZE, block_size=args.seq_len, n_layer=layers, n_head=heads, n_embd=width)


def io_bytes() -> tuple[int, int]:
    """(read, written) bytes this process (all its threads) moved at the block layer."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def raw_bandwidth(directory: str, nbytes: int = 1 << 30, block: int = 8 << 20) -> tuple[float, float]:
    """(write, read) bytes per second of one ``O_DIRECT`` stream of ``block``-byte transfers into a
    file under ``directory`` (what ``dd oflag=direct`` / ``iflag=direct`` measure: no page cache)."""
    path = os.path.join(directory, "bench-raw-bandwidth.bin")
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(block))
    rates = []
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    try:
        for call in (os.pwritev, os.preadv):
            start = time.perf_counter()
            for offset in range(0, nbytes, block):
                call(fd, [buf], offset)
            rates.append(nbytes / (time.perf_counter() - start))
    finally:
        os.close(fd)
        os.unlink(path)
    return rates[0], rates[1]


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def build_parts(config: GPTConfig, directory: str, device: torch.device):
    """parts.offload: shards and AdamW state in a DiskStore, stepping during backward."""
    from parts.offload import DiskStore, OffloadedOptimizer
    from parts.partition import attach, partitioned, shards
    store = DiskStore(os.path.join(directory, f"rank{dist.get_rank()}"))
    with partitioned(device=device, remote_device=store):
        model = GPT(config)
    layer = 12 * config.n_embd ** 2
    attach(model, prefetch_bucket_size=layer, max_live_parameters=2 * layer, max_reuse_distance=0,
           persistence_threshold=4 * config.n_embd, reduce_bucket_size=layer)
    opt = OffloadedOptimizer(torch.optim.AdamW(shards(model), lr=LR, weight_decay=0.0), store)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        with opt.step_in_backward():
            loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step, store.close


def build_memory(config: GPTConfig, directory: str, device: torch.device):
    """The reference: parts' ZeRO-3 in memory, torch AdamW (what both offloaded runs should equal)."""
    from parts.partition import attach, partitioned, shards
    with partitioned(device=device):
        model = GPT(config)
    attach(model)
    opt = torch.optim.AdamW(shards(model), lr=LR, weight_decay=0.0)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step, lambda: None


def build_infinity(config: GPTConfig, directory: str, batch_size: int):
    """DeepSpeed ZeRO-Infinity: ZeRO-3, parameters and optimizer state offloaded to nvme."""
    import deepspeed
    nvme = os.path.join(directory, f"rank{dist.get_rank()}")
    os.makedirs(nvme, exist_ok=True)
    ds_config = {"train_micro_batch_size_per_gpu": batch_size,
                 "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
                 "zero_optimization": {"stage": 3,
                                       "offload_param": {"device": "nvme", "nvme_path": nvme},
                                       "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}
    model = GPT(config)  # built whole, as parts' is before sharding: the same weights; initialize() offloads it
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach()
    return step, lambda: None


def minor_faults() -> int:
    """Minor page faults of this process so far (all its threads): each is a fresh page touched."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _worker(rank: int, world: int, port: int, system: str, args: argparse.Namespace, results) -> None:
    os.environ.update(LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    device = devices.init_spawned(args.device, rank, world, port)  # gloo, or NCCL on GPU ``rank``
    config = config_of(args)
    directory = tempfile.mkdtemp(prefix=f"bench-{system}-", dir=args.dir) if rank == 0 else ""
    holder = [directory]
    dist.broadcast_object_list(holder, src=0)
    torch.manual_seed(0)
    start = time.perf_counter()
    if system == "parts":
        step, close = build_parts(config, holder[0], device)
    elif system == "memory":
        step, close = build_memory(config, holder[0], device)
    else:
        step, close = build_infinity(config, holder[0], args.batch_size)
    built = time.perf_counter() - start
    tokens, _ = load_splits(None)
    gen = torch.Generator().manual_seed(1000 + rank)
    times, losses, io = [], [], None
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            io, load, cpu, faults = io_bytes(), os.getloadavg()[0], cpu_seconds(), minor_faults()
        x, y = devices.to(device, *batch(tokens, args.batch_size, args.seq_len, gen))
        devices.sync(device)
        started = time.perf_counter()
        loss = step(x, y)
        devices.sync(device)
        dist.barrier()
        times.append(time.perf_counter() - started)
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    read, written = (b - a for a, b in zip(io, io_bytes()))
    cpu = (cpu_seconds() - cpu) / args.steps
    faults = (minor_faults() - faults) / args.steps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows = [None] * world
    dist.all_gather_object(rows, (peak, read / args.steps, written / args.steps, cpu, faults))
    if rank == 0:
        load = (load + os.getloadavg()[0]) / 2
        results[system] = dict(step=statistics.median(times[args.warmup:]), built=built, losses=losses, ranks=rows,
                               load=load)
    close()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        shutil.rmtree(holder[0], ignore_errors=True)


def disk_fraction(result: dict, write_rate: float, read_rate: float) -> float:
    """The share of a step the disk would be busy moving every rank's bytes at its raw rates."""
    seconds = sum(rd / read_rate + wr / write_rate for _, rd, wr, *_ in result["ranks"])
    return seconds / result["step"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    args = parse_args()
    os.environ.setdefault("DS_ACCELERATOR", args.device)  # DeepSpeed's: "cpu" or "cuda"
    os.makedirs(args.dir, exist_ok=True)
    psi = count_params(config_of(args))
    print(f"GPT {args.params} ({psi / 1e6:.0f} M params), world {args.world_size}, {args.batch_size}x"
          f"{args.seq_len} tokens per rank, fp32 AdamW lr {LR}, {args.warmup} + {args.steps} steps, "
          f"compute on {args.device}", flush=True)
    write_rate, read_rate = raw_bandwidth(args.dir)
    print(f"raw disk bandwidth under {args.dir} (O_DIRECT, 8 MiB blocks): write {write_rate / MiB:.0f} MiB/s, "
          f"read {read_rate / MiB:.0f} MiB/s; system load {os.getloadavg()[0]:.1f}", flush=True)
    shared, rounds = mp.Manager().dict(), {}
    for _ in range(args.rounds):
        for system in args.systems.split(","):
            rounds.setdefault(system, []).append(_run_system(system, args, shared, write_rate, read_rate))
    results = {system: dict(runs[-1], step=statistics.median(r["step"] for r in runs),
                            rounds=[round(r["step"], 3) for r in runs]) for system, runs in rounds.items()}
    _report(args, psi, results, write_rate, read_rate)


def _run_system(system: str, args: argparse.Namespace, results, write_rate: float, read_rate: float) -> dict:
    """One run of ``system`` in ``--world-size`` processes; prints its line and returns its result
    (a rank that dies after the measured steps were reported, in the system's teardown, is said
    and its result kept; one that dies before fails the run)."""
    results.pop(system, None)
    try:
        mp.spawn(_worker, args=(args.world_size, _free_port(), system, args, results), nprocs=args.world_size)
    except mp.ProcessExitedException as e:
        if system not in results:
            raise
        print(f"{system}: a rank exited after reporting its steps ({e}); its result is kept", flush=True)
    r = dict(results[system])
    print(f"{system}: step {r['step']:.2f} s, built in {r['built']:.1f} s, peak RSS per rank "
          + ", ".join(f"{p / MiB:.0f}" for p, *_ in r["ranks"]) + " MiB, read / written per step per rank "
          + ", ".join(f"{rd / MiB:.0f} / {wr / MiB:.0f}" for _, rd, wr, *_ in r["ranks"])
          + f" MiB ({disk_fraction(r, write_rate, read_rate):.0%} of the disk's raw bandwidth), CPU per step "
          + ", ".join(f"{rank[3]:.2f}" for rank in r["ranks"]) + " s, minor page faults per step "
          + ", ".join(f"{rank[4] / 1e3:.0f}k" for rank in r["ranks"]) + ", "
          + f"system load {r['load']:.1f}, losses "
          + " ".join(f"{v:.4f}" for v in r["losses"]), flush=True)
    return r


def _row(system: str, r: dict, write_rate: float, read_rate: float) -> dict:
    """A system's row of the results file (the step: its median over the rounds; the rest: its last round)."""
    return {"system": system, "step_s": round(r["step"], 3), "step_s_rounds": ", ".join(map(str, r["rounds"])),
            "peak_rss_MiB": ", ".join(f"{p / MiB:.0f}" for p, *_ in r["ranks"]),
            "read_MiB_per_step": ", ".join(f"{rank[1] / MiB:.0f}" for rank in r["ranks"]),
            "written_MiB_per_step": ", ".join(f"{rank[2] / MiB:.0f}" for rank in r["ranks"]),
            "disk_bandwidth_fraction": round(disk_fraction(r, write_rate, read_rate), 3),
            "cpu_s_per_step": ", ".join(f"{rank[3]:.2f}" for rank in r["ranks"]),
            "minor_faults_per_step": ", ".join(f"{rank[4] / 1e3:.0f}k" for rank in r["ranks"]),
            "system_load": round(r["load"], 1),
            "first_loss": round(r["losses"][0], 4), "last_loss": round(r["losses"][-1], 4)}


def _report(args: argparse.Namespace, psi: int, results: dict, write_rate: float, read_rate: float) -> None:
    """Print and record the rows and the side-by-side summary."""
    rows = [_row(s, r, write_rate, read_rate) for s, r in results.items()]
    summary = {"model": f"GPT {args.params} ({psi / 1e6:.0f} M params), world {args.world_size}, "
                        f"{args.batch_size}x{args.seq_len} tokens per rank, {args.warmup} + {args.steps} steps, "
                        f"{args.rounds} round(s)",
               "raw disk MiB/s (O_DIRECT write, read)": f"{write_rate / MiB:.0f}, {read_rate / MiB:.0f}"}
    if {"parts", "infinity"} <= set(results):
        p, d = results["parts"], results["infinity"]
        summary["infinity step / parts step"] = round(d["step"] / p["step"], 2)
        summary["infinity step / parts step, each round"] = ", ".join(
            f"{a / b:.2f}" for a, b in zip(d["rounds"], p["rounds"]))
        summary["infinity CPU / parts CPU"] = round(sum(r[3] for r in d["ranks"]) / sum(r[3] for r in p["ranks"]), 2)
        summary["parts RSS / infinity RSS"] = round(max(r[0] for r in p["ranks"]) / max(r[0] for r in d["ranks"]), 2)
        gap = max(abs(a - b) for a, b in zip(p["losses"], d["losses"]))
        summary["largest loss difference parts - infinity"] = f"{gap:.2e}"
    if "memory" in results:
        ref = results["memory"]["losses"]
        for s in sorted(set(results) - {"memory"}):
            gap = max(abs(a - b) for a, b in zip(results[s]["losses"], ref))
            summary[f"{s}: largest loss difference to in memory"] = f"{gap:.2e}"
        if "parts" in results:
            summary["parts RSS / in-memory RSS"] = round(
                max(r[0] for r in results["parts"]["ranks"]) / max(r[0] for r in results["memory"]["ranks"]), 2)
    print(summary, flush=True)
    record("bench_offload_infinity" + ("" if args.params == "25M" else f"_{args.params}")
           + ("_cuda" if args.device == "cuda" else ""),
           {"rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
