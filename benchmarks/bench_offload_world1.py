"""One process training a GPT whose model states exceed this machine's RAM: ``recipes/train_offload.py``
at world 1, its memory use against its budget.

    python benchmarks/bench_offload_world1.py
    python benchmarks/bench_offload_world1.py --params 1.7B --memory-budget-gib 5 --same-batch --lr 5e-7
    python benchmarks/bench_offload_world1.py --from-log run.log   # record a run already made
    python benchmarks/bench_offload_world1.py --device cuda        # compute on the GPU (recorded as _cuda)

Launches ``torchrun --standalone --nproc-per-node 1 recipes/train_offload.py`` (shards, grads and
AdamW's moments of the whole model in one rank's ``DiskStore``, the optimizer stepping during
backward), tees its output to ``--log``, and records from it: parameters, model-state bytes
(16 per parameter: fp32 values, grads, two moments) against ``MemTotal``, the run's peak RSS
(the recipe's ``VmHWM``, and the largest child's ``ru_maxrss`` as seen here) against the
``--memory-budget-gib`` it was given, each step's time, loss, bytes read and written and the store's
bytes on disk. ``--same-batch`` trains every step on step 1's batch: its loss then falls step by
step, where a fresh 16-token batch a step swings the loss more than four steps move it.
"""

from __future__ import annotations

import argparse
import math
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import devices  # noqa: E402
from record import record  # noqa: E402
from train_offload import PRESETS, config_of, count_params  # noqa: E402

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "train_offload.py"
GiB = 2**30
STEP = re.compile(r"^\[[#.]+\] (\d+)/\d+ loss ([\d.naif]+)\s+step ([\d.]+)s .*?disk read [\d.]+s \(([\d.]+) GiB\)"
                  r"\s+disk write [\d.]+s \(([\d.]+) GiB\).*?RSS/rank (\d+) MiB\s+disk ([\d.]+) GiB/rank")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``args.device`` comes back resolved to ``cpu`` or ``cuda`` (with ``--from-log``,
    ``cuda`` is taken as given: the log may come from another machine)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="1.7B", help="the recipe's --params preset")
    ap.add_argument("--memory-budget-gib", type=float, default=4.0, help="the recipe's --memory-budget-gib")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--store", default="/tmp/parts-offload-w1", help="the recipe's --store (removed at its exit)")
    ap.add_argument("--lr", type=float, default=None, help="the recipe's --lr (None: its lr_for the model)")
    ap.add_argument("--same-batch", action="store_true", help="the recipe's --same-batch (each step on step 1's batch)")
    ap.add_argument("--log", type=Path, default=Path("/tmp/bench_offload_world1.log"))
    ap.add_argument("--from-log", type=Path, default=None, help="parse this log of a finished run, launch nothing")
    devices.add_device_flag(ap)
    args = ap.parse_args(argv)
    if not (args.from_log and args.device == "cuda"):
        args.device = devices.resolve(args.device)
    return args


def mem_total() -> int:
    """``MemTotal`` of /proc/meminfo, bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("bench_offload_world1: no MemTotal in /proc/meminfo")


def recipe_command(args: argparse.Namespace) -> list[str]:
    """The recipe at world 1 with this benchmark's flags."""
    return ["torchrun", "--standalone", "--nproc-per-node", "1", str(RECIPE), "--params", args.params,
            "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--batch-size", "1",
            "--memory-budget-gib", str(args.memory_budget_gib), "--store", args.store, "--device", args.device,
            *["--same-batch"] * args.same_batch, *(["--lr", str(args.lr)] if args.lr else [])]


def launch(args: argparse.Namespace) -> tuple[str, float, int]:
    """Run the recipe, teeing its output to ``args.log``: (output, wall seconds, children's ru_maxrss bytes)."""
    start, lines = time.perf_counter(), []
    with args.log.open("w") as log, subprocess.Popen(recipe_command(args), stdout=subprocess.PIPE,
                                                     stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            lines.append(line)
            log.write(line)
            log.flush()
        if proc.wait():
            raise SystemExit(f"bench_offload_world1: the recipe exited with {proc.returncode}; see {args.log}")
    return "".join(lines), time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def field(pattern: str, out: str) -> str:
    """The first group of ``pattern`` in the recipe's output (a clear error if it printed none)."""
    m = re.search(pattern, out, re.MULTILINE)
    if m is None:
        raise SystemExit(f"bench_offload_world1: no line matching {pattern!r} in the recipe's output")
    return m.group(1)


def steps_of(out: str) -> list[dict]:
    """One dict per step line of the recipe's output."""
    steps = [m.groups() for m in map(STEP.match, out.splitlines()) if m]
    return [{"step": int(s), "loss": float(loss), "step_s": float(t), "read_GiB": float(r), "write_GiB": float(w),
             "rss_MiB": int(rss), "store_GiB": float(d)} for s, loss, t, r, w, rss, d in steps]


def results(out: str, args: argparse.Namespace, wall: float, child_peak: int) -> dict:
    """The recorded table: the run in one row, each step and the budget's reasoning in the summary."""
    steps, (layers, width, _) = steps_of(out), PRESETS[args.params]
    losses, psi, ram = [r["loss"] for r in steps], count_params(config_of(args)), mem_total()
    peak = float(field(r"^peak RSS per rank\s+([\d.]+) GiB", out))
    row = {"model": f"{args.params} ({layers} x {width})", "params": psi,
           "model_states_GiB": round(16 * psi / GiB, 1), "MemTotal_GiB": round(ram / GiB, 1),
           "budget_GiB": args.memory_budget_gib, "peak_RSS_GiB": peak,
           "step_s": ", ".join(f"{r['step_s']:.0f}" for r in steps),
           "read_write_GiB_per_step": f"{statistics.median(r['read_GiB'] for r in steps):.1f} / "
                                      f"{statistics.median(r['write_GiB'] for r in steps):.1f}",
           "store_GiB": max((r["store_GiB"] for r in steps), default=0.0),
           "batches": "step 1's, every step" if args.same_batch else "a new one each step",
           "lr": field(r"AdamW lr (\S+) ", out),
           "losses": ", ".join(f"{v:.4f}" for v in losses),
           "step_1_batch_before_after": field(r"^step 1's batch: loss before -> after training\s+(.+)$", out).strip()}
    summary = {
        "memory budget": field(r"^memory budget per rank\s+(.+)$", out).strip(),
        "bound of the knobs": (re.findall(r"^\s+bound of these knobs\s+(.+)$", out, re.MULTILINE) or ["n/a"])[0],
        "peak RSS of the child (ru_maxrss)": f"{child_peak / GiB:.2f} GiB" if child_peak else "n/a (from a log)",
        "losses finite": all(map(math.isfinite, losses)),
        "built in": field(r"^built in (\S+);", out),
        "total wall": f"{wall:.0f} s" if wall else field(r"^total time\s+(\S+)", out),
        "system load (1, 5, 15 min)": field(r"^system load \(1, 5, 15 min\)\s+(.+)$", out).strip(),
    }
    summary.update({f"step {r['step']}": ", ".join(f"{k} {v}" for k, v in r.items() if k != "step") for r in steps})
    return {"rows": [row], "summary": summary}


def main() -> None:
    """Run (or read) the world-1 recipe and record its numbers."""
    args = parse_args()
    if args.from_log:
        out, wall, child_peak = args.from_log.read_text(), 0.0, 0
    else:
        out, wall, child_peak = launch(args)
    table = results(out, args, wall, child_peak)
    command = " ".join(["python", "benchmarks/bench_offload_world1.py", "--params", args.params,
                        "--memory-budget-gib", str(args.memory_budget_gib), "--steps", str(args.steps),
                        "--seq-len", str(args.seq_len), *["--same-batch"] * args.same_batch,
                        *(["--lr", str(args.lr)] if args.lr else []), "--device", args.device])
    print(record("bench_offload_world1" + ("_cuda" if args.device == "cuda" else ""), table, command=command))
    for key, value in [*table["rows"][0].items(), *table["summary"].items()]:
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
