"""A rank of the main recipe fails mid-run under ``torchrun --max-restarts 1``; the restarted
group continues from host-memory snapshots (``--snapshot-every``).

    python benchmarks/bench_kill.py --world 2 --runs 5                 # SIGKILL, SIGSTOP, exception
    python benchmarks/bench_kill.py --world 4 --runs 2          # recorded as bench_kill_world4
    python benchmarks/bench_kill.py --world 2 --runs 0 --overhead-rounds 3   # the overhead only

Each run launches ``recipes/train_gpt.py --dtype fp32 --heartbeat --snapshot-every K`` and makes
one random rank fail after one random step (the recipe's test-only ``PARTS_RECIPE_FAIL``):
**kill** (SIGKILL), **stop** (SIGSTOP: a hang that only ``--heartbeat`` detects) or **raise**
(a ``RuntimeError``). The recipe writes its disk checkpoint (``--out``) only at its end, and
the benchmark removes that folder as the failure happens, so the restart has only the
snapshots. Reported per kind (medians over the runs, maxima where named):

- **detect s**: the failure to the agent's log of a failed worker (for a stop, a peer's
  heartbeat names the stopped rank and exits first);
- **restart s**: from there to the restarted workers' restore call (the agent stops the others:
  it waits 30 s for a stopped worker to answer SIGTERM; then it relaunches, and each worker
  imports torch, joins the group and builds the model);
- **launch s**: the part of the restart up to the slowest restarted worker's first line of
  ``main`` (the agent's stop and relaunch, the interpreter's start and the imports);
- **restore s**: the restore call (the slowest rank);
- **fail to step s**: the failure to the first step finished after the restart (slowest rank);
- **steps lost**: steps computed twice (the failure's step minus the snapshot's);
- **disk bytes**: bytes the restarted workers read from storage during the restore
  (``/proc/self/io``; the snapshots are in ``/dev/shm``, memory);
- **equal**: runs whose final weights and optimizer state equal, bitwise, an uninterrupted run's.

``--overhead-rounds R`` also runs the recipe R times each without and with ``--snapshot-every``
(its default K), alternating, and reports the training time with snapshots over that without,
and what one snapshot costs: the time the save call holds the loop and the CPU time of its
background thread.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "recipes"))
from record import record  # noqa: E402
from resilience import SNAPSHOT_EVERY  # noqa: E402

AGENT_FAILURE = re.compile(r"^[WEI]\d{4} (\d\d):(\d\d):(\d\d\.\d+) \d+ .*(failed \(exitcode|closing signal)",
                           re.MULTILINE)


def launch(args: argparse.Namespace, out: Path, env: dict, snapshot_every: int, steps: int,
           restarts: int = 1, heartbeat: bool = True) -> tuple[int, str]:
    """Run the recipe under torchrun; (exit status, its output)."""
    flags = ["--steps", str(steps), "--dtype", "fp32", "--plot", "", "--sample-chars", "5", "--eval-interval",
             "100000", "--eval-batches", "1", "--out", str(out)]
    flags += ["--snapshot-every", str(snapshot_every)] if snapshot_every else []
    flags += ["--heartbeat"] if heartbeat else []
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.world),
               "--max-restarts", str(restarts), "--monitor-interval", "0.1", str(ROOT / "recipes" / "train_gpt.py"),
               *flags]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    done = subprocess.run(command, env=full_env, cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=args.timeout)
    return done.returncode, done.stdout


def weights(path: Path) -> dict:
    """Every value of the DCP checkpoint at ``path``, by its flattened key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(path, path.with_suffix(".pt"))
    flat: dict = {}

    def walk(value, prefix):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = value
    walk(torch.load(path.with_suffix(".pt"), weights_only=False), "")
    return flat


def equal(a: dict, b: dict) -> bool:
    if sorted(a) != sorted(b):
        return False
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def remove_when_failed(path: Path, out: Path, stop: threading.Event) -> None:
    """Remove the disk checkpoint folder as soon as the failure is noted."""
    while not stop.is_set():
        if any(e["event"] == "fail" for e in events(path)):
            shutil.rmtree(out, ignore_errors=True)
            return
        time.sleep(0.05)


def agent_time(output: str, after: float) -> float | None:
    """The wall-clock time of the agent's first log of a failed worker after ``after``."""
    day = time.localtime(after)
    for match in AGENT_FAILURE.finditer(output):
        h, m, s = int(match.group(1)), int(match.group(2)), float(match.group(3))
        at = time.mktime((day.tm_year, day.tm_mon, day.tm_mday, h, m, 0, 0, 0, -1)) + s
        if at >= after - 1.0:
            return at
    return None


def one_run(args: argparse.Namespace, kind: str, rank: int, step: int, reference: dict, work: Path,
            index: int) -> dict:
    """One failure (the ``index``-th of its kind: runs that draw the same rank and step keep apart); what it cost."""
    name = f"{kind}-{index}-rank{rank}-step{step}"
    log, out = work / f"{name}.jsonl", work / name
    stop = threading.Event()
    watcher = threading.Thread(target=remove_when_failed, args=(log, out, stop), daemon=True)
    watcher.start()
    code, output = launch(args, out, {"PARTS_RECIPE_FAIL": f"{kind}:{rank}:{step}", "PARTS_RECIPE_EVENTS": str(log)},
                          args.every, args.steps)
    stop.set()
    seen = events(log)
    fail = next((e for e in seen if e["event"] == "fail"), None)
    restored = [e for e in seen if e["event"] == "restored" and e["restart"] == 1]
    firsts = [e for e in seen if e["event"] == "first step" and e["restart"] == 1]
    started = [e for e in seen if e["event"] == "started" and e["restart"] == 1]
    row = {"kind": kind, "rank": rank, "step": step, "rc": code, "restored": len(restored) == args.world}
    if code != 0 or fail is None or not row["restored"] or not out.exists():  # counted as not equal
        row["tail"] = output[-2000:]
        return row
    detected = agent_time(output, fail["time"])
    began = min(e["time"] - e["seconds"] for e in restored)
    row.update(detect_s=round(detected - fail["time"], 2) if detected else None,
               restart_s=round(began - detected, 2) if detected else None,
               launch_s=round(max(e["time"] for e in started) - detected, 2) if detected and started else None,
               restore_s=round(max(e["seconds"] for e in restored), 3),
               fail_to_step_s=round(max(e["time"] for e in firsts) - fail["time"], 2),
               steps_lost=step - restored[0]["step"], disk_bytes=sum(e["disk_bytes"] for e in restored),
               equal=equal(weights(out), reference))
    return row


def per_kind(kind: str, rows: list[dict]) -> dict:
    """The table row of one failure kind over its runs."""
    ok = [r for r in rows if "equal" in r]

    def median(key: str) -> float | str:
        values = [r[key] for r in ok if r.get(key) is not None]
        return round(statistics.median(values), 2) if values else ""
    return {"kind": kind, "runs": len(rows), "finished": sum(r["rc"] == 0 for r in rows),
            "equal": sum(bool(r.get("equal")) for r in rows), "detect_s": median("detect_s"),
            "restart_s": median("restart_s"), "launch_s": median("launch_s"), "restore_s": median("restore_s"),
            "fail_to_step_s": median("fail_to_step_s"),
            "fail_to_step_max_s": max((r["fail_to_step_s"] for r in ok), default=""),
            "steps_lost_max": max((r["steps_lost"] for r in ok), default=""),
            "disk_bytes_max": max((r["disk_bytes"] for r in ok), default="")}


def overhead(args: argparse.Namespace, work: Path) -> dict:
    """The snapshot overhead at the default K: runs without and with snapshots, alternating,
    each one's steps beyond ``steps x`` its own median step (so the load of a shared machine
    during a run cancels out; the runs without snapshots give the floor)."""
    beyond: dict[str, list[float]] = {"off": [], "on": []}
    wall: dict[str, list[float]] = {"off": [], "on": []}
    medians, saves = [], []
    for round_ in range(args.overhead_rounds):
        for mode, every in (("off", 0), ("on", SNAPSHOT_EVERY)):
            log = work / f"overhead-{mode}-{round_}.jsonl"
            code, output = launch(args, work / f"overhead-{mode}-{round_}", {"PARTS_RECIPE_EVENTS": str(log)},
                                  every, args.overhead_steps, restarts=0, heartbeat=False)
            if code != 0:
                raise SystemExit(f"overhead run {mode} failed:\n{output[-3000:]}")
            trained = [e for e in events(log) if e["event"] == "trained"]
            slowest = max(trained, key=lambda e: e["beyond_median"])
            beyond[mode].append(100 * slowest["beyond_median"] / (slowest["median_step"] * args.overhead_steps))
            wall[mode].append(max(e["seconds"] for e in trained))
            medians.append(slowest["median_step"])
            saves += [e for e in events(log) if e["event"] == "snapshots"]
    count = sum(e["saves"] for e in saves)
    held, thread = sum(e["seconds"] for e in saves) / count, sum(e["thread_seconds"] for e in saves) / count
    step = statistics.median(medians)
    off, on = statistics.median(beyond["off"]), statistics.median(beyond["on"])
    return {"default K": SNAPSHOT_EVERY, "overhead runs": f"{args.overhead_rounds} x {args.overhead_steps} steps "
            f"each way, alternating", "median step s": round(step, 4),
            "steps beyond the median pct, without / with snapshots (median of runs)": f"{off:.1f} / {on:.1f}",
            "snapshot overhead pct (with minus without)": round(on - off, 1),
            "training s without / with snapshots (median of runs)":
                f"{statistics.median(wall['off']):.2f} / {statistics.median(wall['on']):.2f}",
            "save call s (loop held, mean)": round(held, 4),
            "background thread CPU s per snapshot": round(thread, 4),
            "bound pct: (save call + thread CPU) / (K x median step)":
                round(100 * (held + thread) / (SNAPSHOT_EVERY * step), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5, help="runs per failure kind")
    ap.add_argument("--kinds", default="kill,stop,raise")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10, help="K of the failure runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overhead-rounds", type=int, default=0)
    ap.add_argument("--overhead-steps", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args()
    draw = random.Random(args.seed)
    rows, summary = [], {"world": args.world, "steps": args.steps, "K": args.every}
    with tempfile.TemporaryDirectory(prefix="bench-kill-") as tmp:
        work = Path(tmp)
        if args.runs:
            code, output = launch(args, work / "reference", {}, args.every, args.steps, restarts=0)
            if code != 0:
                raise SystemExit(f"the uninterrupted run failed:\n{output[-3000:]}")
            reference = weights(work / "reference")
            for kind in args.kinds.split(","):
                runs = [one_run(args, kind, draw.randrange(args.world), draw.randint(args.every + 1, args.steps - 1),
                                reference, work, index) for index in range(args.runs)]
                for run in runs:
                    print(json.dumps(run), flush=True)
                rows.append(per_kind(kind, runs))
        if args.overhead_rounds:
            summary.update(overhead(args, work))
    print(json.dumps({"rows": rows, "summary": summary}, indent=1))
    record("bench_kill" if args.world == 2 else f"bench_kill_world{args.world}", {"rows": rows, "summary": summary},
           command="python " + " ".join(["benchmarks/bench_kill.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
