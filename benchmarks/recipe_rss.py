"""Peak RSS of the main recipe per rank, at step 100 and at its last step, over several runs.

    python benchmarks/recipe_rss.py --runs 5
    python benchmarks/recipe_rss.py --runs 5 --device cuda   # the recipe on two GPUs; records recipe_rss_cuda

Each run is the Quick start's command (``torchrun --standalone --nproc-per-node 2
recipes/train_gpt.py``, 1,100 steps by default) with ``--memory-every 100``, which makes the recipe
print every rank's RSS and peak RSS (VmHWM) every 100 steps. A run passes when every rank's peak
at the last step is within ``--tolerance`` (5%) of its peak at step 100: a per-step leak or a heap
that fragments over the run shows as growth after warm-up.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import devices  # noqa: E402
from record import record  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MEMORY_LINE = re.compile(r"step (\d+): RSS MiB per rank ([\d. ]+), peak ([\d. ]+)")


def memory_by_step(output: str) -> dict[int, tuple[list[float], list[float]]]:
    """``{step: (RSS per rank, peak RSS per rank)}`` from the recipe's ``--memory-every`` notes."""
    found = {}
    for step, rss, peak in MEMORY_LINE.findall(output):
        found[int(step)] = ([float(x) for x in rss.split()], [float(x) for x in peak.split()])
    return found


def one_run(steps: int, extra: list[str]) -> tuple[dict, float]:
    """Run the recipe once; its memory notes and wall seconds. Raises naming the exit code."""
    command = ["torchrun", "--standalone", "--nproc-per-node", "2", "recipes/train_gpt.py",
               "--steps", str(steps), "--memory-every", "100", *extra]
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return memory_by_step(done.stdout + done.stderr), time.monotonic() - start


def run_row(run: int, memory: dict, seconds: float, tolerance: float) -> dict:
    """One run's table row: peak RSS per rank at step 100 and at the last step, and the growth."""
    last = max(memory)
    early, late = memory[100][1], memory[last][1]
    growth = max(b / a - 1 for a, b in zip(early, late))
    return {"run": run, "steps": last, "peak_MiB_step_100": " / ".join(f"{x:.0f}" for x in early),
            f"peak_MiB_step_{last}": " / ".join(f"{x:.0f}" for x in late),
            "largest_growth": f"{growth:+.1%}", "within": growth <= tolerance, "wall_s": round(seconds, 1)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags (``args.extra``: the rest, passed to the recipe); ``args.device`` resolved to ``cpu`` or ``cuda``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=1100)
    ap.add_argument("--tolerance", type=float, default=0.05, help="largest allowed peak growth (0.05: 5%%)")
    devices.add_device_flag(ap)
    args, args.extra = ap.parse_known_args(argv)
    args.device = devices.resolve(args.device)
    return args


def main() -> int:
    """Run the recipe ``--runs`` times, print and record the peak RSS growth of each run."""
    args = parse_args()
    rows = []
    for run in range(1, args.runs + 1):
        memory, seconds = one_run(args.steps, ["--device", args.device, *args.extra])
        rows.append(run_row(run, memory, seconds, args.tolerance))
        print(rows[-1], flush=True)
    passed = sum(r["within"] for r in rows)
    summary = {"runs within tolerance": f"{passed} of {len(rows)} (peak RSS growth <= {args.tolerance:.0%} "
                                        "from step 100 to the last step, every rank)"}
    print(summary)
    record("recipe_rss" + ("_cuda" if args.device == "cuda" else ""), {"rows": rows, "summary": summary})
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
