"""Peak RSS per phase (forward, backward, optimizer step) of bench_zero3's systems, per rank.

    python benchmarks/phase_rss.py fsdp2_bf16,parts_lean_bf16,parts_bf16 --steps 5

Each system trains bench_zero3's bf16 anchor model (the 25.4M GPT, world 2, same builders,
data and mmap threshold) in fresh processes; before each phase the kernel's peak-RSS mark
(VmHWM) is reset (``/proc/self/clear_refs``, Linux), so each phase reports its own peak and
its end, in MiB over the process's RSS before the model was built. Where a system's peak
RSS comes from, phase by phase. Linux only.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import bench_zero3  # noqa: E402
from gpt_model import GPTConfig  # noqa: E402
from record import record  # noqa: E402


def _rss_mib() -> dict[str, float]:
    """VmRSS and VmHWM of this process in MiB."""
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return out


def _reset_peak() -> None:
    """Reset this process's peak-RSS mark to its current RSS."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def _phase(run: Callable[[], Any], base: float) -> tuple[Any, str]:
    """Run ``run()`` with a fresh peak mark; its peak and end RSS over ``base``."""
    _reset_peak()
    result = run()
    rss = _rss_mib()
    return result, f"peak +{rss['VmHWM'] - base:.0f} end +{rss['VmRSS'] - base:.0f}"


def _worker(rank: int, world: int, port: int, system: str, config: GPTConfig, args: argparse.Namespace,
            out: Any) -> None:
    """One rank: build ``system``, train, record each phase's peak and end RSS into ``out``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from parts.observe import set_mmap_threshold
    set_mmap_threshold(128 * 1024)
    torch.manual_seed(0)
    base = _rss_mib()["VmRSS"]
    build = bench_zero3._ddp_anchor if system == "ddp" else getattr(bench_zero3, f"build_{system}")
    model, optimizer, coordinator = build(config)
    lines = [f"{system} rank {rank}: built +{_rss_mib()['VmRSS'] - base:.0f} MiB"]
    for step, (inputs, targets) in enumerate(bench_zero3._batches(config, args, rank)):
        loss, fwd = _phase(lambda: model(inputs, targets), base)
        _, bwd = _phase(loss.backward, base)
        _, opt = _phase(lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True)), base)
        lines.append(f"  step {step}: forward {fwd}, backward {bwd}, optimizer {opt}")
    if coordinator is not None:
        stats = coordinator.stats()
        lines.append(f"  pool {stats.cached_bytes / 2**20:.1f} MiB, live high-water "
                     f"{stats.live_high_water} elements")
    out[(system, rank)] = "\n".join(lines)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("systems", help=f"comma-separated, of {', '.join(bench_zero3.BF16_SYSTEMS)}")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    from chardata import VOCAB_SIZE
    shape = bench_zero3.MODELS["25m"]
    config = GPTConfig(vocab_size=VOCAB_SIZE, block_size=shape["seq"], n_layer=shape["n_layer"],
                       n_head=shape["n_head"], n_embd=shape["n_embd"])
    batches = argparse.Namespace(dtype="bf16", batch=4, steps=args.steps)
    out = mp.Manager().dict()
    rows = []
    for system in args.systems.split(","):
        mp.spawn(_worker, args=(2, bench_zero3._free_port(), system, config, batches, out), nprocs=2)
        for rank in (0, 1):
            print(out[(system, rank)], flush=True)
            rows.append({"system": system, "rank": rank, "RSS MiB over the pre-build RSS, by phase":
                         "; ".join(line.strip() for line in out[(system, rank)].splitlines()[1:])})
    record("phase_rss", {"rows": rows, "summary": {"model": "25.4M GPT, bf16, world 2", "steps": args.steps}})


if __name__ == "__main__":
    main()
