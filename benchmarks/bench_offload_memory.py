"""Benchmark the offload memory bound across layer widths: peak-RSS growth per added layer,
offloaded against in memory.

    python benchmarks/bench_offload_memory.py
    python benchmarks/bench_offload_memory.py --widths 512 1024 2048 4096 8192

For each width, stacks of ``Linear(width, width)`` blocks (``tests/offload_memory_job.py``'s
sweep: world 1, AdamW, the offloaded run stepping during backward) are trained for two steps at
two depths, each in a fresh process per mode (offloaded, in memory; one run after the other, so
the two do not compete for the cores). Every window (the store's in-flight cap and reuse pool,
the optimizer chunk, the coordinator's live budget) is sized by the same ``memory_budget``: the
smallest that holds one layer's step (``min_budget``). Growth per layer = (peak RSS growth at the
deeper run - at the shallower) / the added layers; the offloaded run's target is at most 0.25x
the in-memory one's. The measured growth is also set against ``memory_bound`` of the run's knobs
(its activations included): the bound's margin is bound / measured.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import record  # noqa: E402

JOB = Path(__file__).resolve().parent.parent / "tests" / "offload_memory_job.py"
DEPTHS = {512: (8, 32), 1024: (4, 16), 2048: (4, 12), 4096: (4, 8), 8192: (4, 6)}
MiB = 2**20


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--store", default=tempfile.gettempdir())
    return ap.parse_args()


def sweep(mode: str, widths: list[int], store: str) -> dict[int, list[tuple[int, int, int]]]:
    """width -> [(layers, growth, bound)] of one mode's fresh process."""
    env = dict(os.environ, PYTHONPATH=str(JOB.parent.parent))
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    specs = [f"{w}:{','.join(map(str, DEPTHS[w]))}" for w in widths]
    out = subprocess.run([sys.executable, str(JOB), store, "sweep", mode, *specs], env=env,
                         capture_output=True, text=True, check=True).stdout
    runs: dict[int, list[tuple[int, int, int]]] = {}
    for row in out.strip().splitlines():
        width, layers, growth, bound = map(int, row.split())
        runs.setdefault(width, []).append((layers, growth, bound))
    return runs


def per_layer(runs: list[tuple[int, int, int]]) -> float:
    """Growth per added layer between the two depths, bytes."""
    (a, ga, _), (b, gb, _) = runs
    return (gb - ga) / (b - a)


def main() -> None:
    args = parse_args()
    unknown = [w for w in args.widths if w not in DEPTHS]
    if unknown:
        raise SystemExit(f"bench_offload_memory: no depths for widths {unknown}; known: {sorted(DEPTHS)}")
    with tempfile.TemporaryDirectory(dir=args.store) as store:
        off, mem = sweep("offload", args.widths, store), sweep("memory", args.widths, store)
    rows = []
    for w in args.widths:
        o, m = per_layer(off[w]), per_layer(mem[w])
        (la, ga, ba), (lb, gb, bb) = off[w]
        rows.append({"width": w, "depths": f"{la}, {lb}",
                     "offloaded_MiB_per_layer": round(o / MiB, 1), "in_memory_MiB_per_layer": round(m / MiB, 1),
                     "ratio": round(o / m, 3), "offloaded_peak_growth_MiB": f"{ga / MiB:.0f}, {gb / MiB:.0f}",
                     "in_memory_peak_growth_MiB": ", ".join(f"{g / MiB:.0f}" for _, g, _ in mem[w]),
                     "memory_bound_MiB": f"{ba / MiB:.0f}, {bb / MiB:.0f}",
                     "bound_over_measured": round(min(ba / ga, bb / gb), 2)})
        print(rows[-1], flush=True)
    record("bench_offload_memory", {"rows": rows, "summary": {
        "worst_ratio": max(r["ratio"] for r in rows),
        "smallest_bound_margin": min(r["bound_over_measured"] for r in rows)}})


if __name__ == "__main__":
    main()
