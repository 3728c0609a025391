"""Checkpoint saves inside a training loop: blocking ``dcp.save`` against ``dcp.async_save``.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_async_save.py          # 25M GPT, world 2
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_async_save.py --steps 20 --rounds 1

The recipes' GPT (8 layers x 512, as bench_checkpoint_dcp's 25M model), sharded and attached
with recipes/train_gpt.py's ``build`` (BF16Optimizer over AdamW, LR schedule), trains on random
tokens. Each round runs ``--steps`` steps three ways, in turn: **none** (no save), **blocking**
(``dcp.save`` of the recipe's checkpoint state every ``--every`` steps) and **async**
(``dcp.async_save`` of the same state every ``--every`` steps; the run waits for the last one
at its end, inside its time). Reported per mode (the last round; each number the slowest
rank's): the run's time, its median step, the overhead (the time its steps and save calls
took beyond ``steps x`` its own median step, so that the load of a shared machine during the
run cancels out: **none**'s is the noise floor; steps slowed by a background write count),
the mean time a save call blocks the loop, for async the steps until each save was seen
committed, the peak RSS growth over the RSS at the start of the run (host buffers made in
an earlier round are reused, not counted again), and the run's time against **none**'s run in
the same round (the median over the rounds: the modes of a round run back to back, so a shared
machine's load slows them alike).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import devices  # noqa: E402
import train_gpt  # noqa: E402
from chardata import VOCAB_SIZE, batch  # noqa: E402
from record import record  # noqa: E402

from parts.comm import all_gather_objects, broadcast_object, dcp  # noqa: E402
from parts.comm.async_save import _Process  # noqa: E402  (the host copy's size)
from parts.partition import is_partitioned, meta  # noqa: E402


MODES = ("none", "blocking", "async")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The peak RSS growth of this process while the block runs (sampled every millisecond)."""

    def __enter__(self) -> "PeakRss":
        self.base, self.peak, self._done = _rss(), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.growth = max(self.peak, _rss()) - self.base


def run_mode(mode: str, parts: tuple, args: argparse.Namespace, path: str, device: torch.device) -> dict:
    """``args.steps`` training steps saving every ``args.every`` steps as ``mode`` says."""
    model, optimizer, schedule = parts
    generator = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(VOCAB_SIZE, (1 << 16,), generator=generator)
    calls, commits, steps, pending, issued = [], [], [], None, 0
    dist.barrier()
    with PeakRss() as rss:
        started = time.perf_counter()
        for step in range(1, args.steps + 1):
            inputs, targets = devices.to(device, *batch(tokens, args.batch_size, args.seq_len, generator))
            begun = time.perf_counter()
            train_gpt.train_step(model, optimizer, schedule, inputs, targets)
            devices.sync(device)
            steps.append(time.perf_counter() - begun)
            if pending is not None and pending.done():
                commits.append(step - issued)
                pending.wait()
                pending = None
            if mode != "none" and step % args.every == 0:
                state = train_gpt.checkpoint_state(model, optimizer, schedule, step)
                call = time.perf_counter()
                if mode == "blocking":
                    dcp.save(state, checkpoint_id=path)
                else:
                    if pending is not None:
                        commits.append(None)  # still running at the next save: that save waits
                    pending, issued = dcp.async_save(state, checkpoint_id=path), step
                calls.append(time.perf_counter() - call)
        if pending is not None:
            pending.wait()
        devices.sync(device)
        dist.barrier()
        elapsed = time.perf_counter() - started
    return {"elapsed": elapsed, "calls": calls, "commits": commits, "steps": steps, "rss": rss.growth}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``args.device`` comes back resolved to ``cpu`` or ``cuda``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps per mode and round")
    parser.add_argument("--every", type=int, default=10, help="steps between saves")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the three modes; the last is reported")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    return devices.parse_with_device(parser, argv)


def main() -> None:
    args = parse_args()
    device = devices.init(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    recipe = train_gpt.parse_args(["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", "8",
                                   "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
                                   "--dtype", "fp32", "--device", args.device])
    model, _, optimizer, schedule = train_gpt.build(recipe, device)
    params = sum(meta(p).numel if is_partitioned(p) else p.numel() for p in model.parameters())
    scratch = broadcast_object(args.dir or (tempfile.mkdtemp(prefix="bench-async-") if rank == 0 else None), src=0)
    rows, elapsed = {}, {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        for mode in MODES:
            rows[mode] = run_mode(mode, (model, optimizer, schedule), args, os.path.join(scratch, mode), device)
            elapsed[mode].append(rows[mode]["elapsed"])
            if rank == 0:
                print(f"round {round_ + 1} {mode}: {rows[mode]['elapsed']:.2f} s", flush=True)
    every = all_gather_objects({**rows, "host_copy": _Process.host.nbytes, "elapsed": elapsed})
    if rank == 0:
        report(args, every, params, world)
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def _overhead(row: dict) -> float:
    """Percent the run's steps and save calls took beyond ``steps x`` its own median step: the
    machine's speed during the run cancels out, the steps a background write slowed count."""
    median = statistics.median(row["steps"])
    spent = sum(row["steps"]) + sum(row["calls"])
    return 100 * (spent / (len(row["steps"]) * median) - 1)


def _vs_none(every: list[dict], mode: str) -> float:
    """Percent ``mode``'s run took beyond **none**'s run of the same round (slowest ranks), the
    median over the rounds."""
    rounds = len(every[0]["elapsed"][mode])
    slowest = {m: [max(r["elapsed"][m][i] for r in every) for i in range(rounds)] for m in ("none", mode)}
    return statistics.median(100 * (t / base - 1) for t, base in zip(slowest[mode], slowest["none"]))


def report(args: argparse.Namespace, every: list[dict], params: int, world: int) -> None:
    """Print and record the table (per mode: the slowest rank's numbers)."""
    table = []
    for mode in MODES:
        ranks = [r[mode] for r in every]
        calls = [max(r["calls"][i] for r in ranks) for i in range(len(ranks[0]["calls"]))]
        table.append({"mode": mode, "run_s": round(max(r["elapsed"] for r in ranks), 2),
                      "median_step_s": round(max(statistics.median(r["steps"]) for r in ranks), 3),
                      "overhead_pct": round(max(_overhead(r) for r in ranks), 1),
                      "save_call_s": round(sum(calls) / len(calls), 3) if calls else "",
                      "saves": len(calls),
                      "committed_after_steps": ", ".join(map(str, ranks[0]["commits"])) if mode == "async" else "",
                      "peak_rss_growth_MiB": round(max(r["rss"] for r in ranks) / 2**20, 1),
                      "run_vs_none_pct": round(_vs_none(every, mode), 1)})
    print(f"\nGPT {params / 1e6:.1f}M params, world {world}, {args.steps} steps per mode, a save every "
          f"{args.every} steps; host copy per rank: {every[0]['host_copy'] / 2**20:.1f} MiB")
    for row in table:
        print("  ".join(f"{k} {v}" for k, v in row.items()))
    record("bench_async_save", {"rows": table, "summary": {
        "params (M)": round(params / 1e6, 1), "world": world, "steps": args.steps, "every": args.every,
        "host_copy_MiB_per_rank": round(every[0]["host_copy"] / 2**20, 1)}})


if __name__ == "__main__":
    main()
