"""SIGTERM to a training job with shards on disk, N times: what each run leaves behind.

    python benchmarks/sigterm_scratch.py --runs 20 --when build,step,end --target torchrun,workers

Each run starts ``torchrun --standalone --nproc-per-node 2 recipes/train_offload.py`` (25M
parameters, shards and AdamW state in a ``DiskStore`` per rank) in a fresh directory that is its
cwd, its ``TMPDIR`` and the parent of its ``--store``; waits for a point of the run (``when``:
``start`` a random time into the launch; ``make`` as soon as a store's directory appears, while
the stores reclaim a dead run's directory of ``--dead-files`` files per rank; ``build`` the model
being built; ``step`` a random time into the training steps; ``end`` the final report, while the
stores close; ``none`` no signal: the baseline); then sends SIGTERM (``target``: ``torchrun`` the
launcher, as ``timeout``, Slurm and Kubernetes do; ``workers`` each worker's process group;
``both`` the launcher and the workers at once, as Slurm's signal to every process of a step does).
After the launcher exits it lists every file left in that directory (scratch stores but the dead
run's, cwd, TMPDIR) and the new entries of ``/dev/shm`` (machine-wide: another process's may show),
with their sizes, and whether a worker outlived the launcher. ``--code`` runs another checkout of
``parts`` (an older commit).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKERS = {"build": "scratch stores", "step": "] 1/", "end": "total time"}


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
                found.append(int(entry))
    return found


CLEAN_DIRS = re.compile(r"^(cwd|store|store/rank\d+|tmp/torchelastic_[^/]+(/.*)?|tmp/torchinductor_[^/]+)/$")
"""Empty directories a run that is not signalled leaves too: the cwd, the store's parents, the
launcher's and inductor's directories under TMPDIR."""


def files_under(top: Path) -> list[tuple[str, int]]:
    """Every file and every empty directory (but ``CLEAN_DIRS``) under ``top``, relative, with its size."""
    out = []
    for root, dirs, files in os.walk(top):
        for name in files:
            path = Path(root, name)
            out.append((str(path.relative_to(top)), path.lstat().st_size))
        rel = str(Path(root).relative_to(top)) + "/"
        if not dirs and not files and Path(root) != top and not CLEAN_DIRS.match(rel):
            out.append((rel, 0))
    return sorted(out)


def wait_for(log: Path, marker: str, proc: subprocess.Popen, limit: float) -> bool:
    """True once ``marker`` appears in ``log``; False if the run ends or ``limit`` seconds pass first."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        if marker in log.read_text(errors="replace"):
            return True
        time.sleep(0.05)
    return False


def plant_dead_run(store: Path, args: argparse.Namespace) -> set[str]:
    """A SIGKILLed run's directory under each rank's store path: an owner record of a process that
    has exited and ``--dead-files`` files; their paths."""
    dead = set()
    for rank in range(2):
        directory = store / f"rank{rank}" / "parts-store-dead"
        directory.mkdir(parents=True)
        record = f"from parts.offload import _scratch; _scratch.write_owner({str(directory)!r})"
        subprocess.run([sys.executable, "-c", record], env={**os.environ, "PYTHONPATH": str(args.code)}, check=True)
        for i in range(args.dead_files):
            os.close(os.open(directory / f"{i:08d}.bin", os.O_CREAT | os.O_WRONLY, 0o600))
        dead.add(str(directory))
    return dead


def wait_for_new_store(store: Path, dead: set[str], proc: subprocess.Popen, limit: float) -> bool:
    """True once a rank's store path holds a directory besides the dead run's."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        found = [p for p in store.glob("rank*/parts-store-*") if str(p) not in dead]
        if found:
            return True
        time.sleep(0.001)
    return False


def signal_run(proc: subprocess.Popen, target: str) -> list[int]:
    """SIGTERM the launcher, its workers' process groups, or both; the workers' pids."""
    workers = children(proc.pid)
    if target in ("torchrun", "both"):
        os.kill(proc.pid, signal.SIGTERM)
    if target in ("workers", "both"):
        for pid in workers:
            try:
                os.killpg(os.getpgid(pid), signal.SIGTERM)
            except ProcessLookupError:
                pass
    return workers


def one_run(args: argparse.Namespace, when: str, target: str, rng: random.Random) -> dict:
    """One launched, SIGTERMed run; what it left."""
    top = Path(tempfile.mkdtemp(prefix="sigterm-scratch-", dir=args.root))
    for sub in ("cwd", "tmp"):
        (top / sub).mkdir()
    log = Path(f"{top}.log")
    shm_before = set(os.listdir("/dev/shm"))
    dead = plant_dead_run(top / "store", args) if when == "make" else set()
    env = {**os.environ, "TMPDIR": str(top / "tmp"),
           "PYTHONPATH": os.pathsep.join([str(args.code), str(args.code / "recipes")])}
    command = ["torchrun", "--standalone", "--nproc-per-node", "2", str(args.code / "recipes" / "train_offload.py"),
               "--params", args.params, "--steps", str(args.steps), "--store", str(top / "store")]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=top / "cwd", env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    delay = 0.0
    if when == "none":
        reached = True
    elif when == "make":
        reached = wait_for_new_store(top / "store", dead, proc, 300)
    elif when == "start":
        delay = rng.uniform(2.0, 20.0)
        time.sleep(delay)
        reached = proc.poll() is None
    else:
        reached = wait_for(log, MARKERS[when], proc, 300)
        delay = rng.uniform(0.0, args.jitter) if when != "end" else 0.0
        time.sleep(delay)
    workers = signal_run(proc, target) if proc.poll() is None and when != "none" else []
    try:
        code = proc.wait(300 if when == "none" else 120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = "hung"
    time.sleep(0.5)
    survivors = [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    left = [entry for entry in files_under(top) if "/parts-store-dead" not in entry[0]]  # not this run's
    shm = sorted(set(os.listdir("/dev/shm")) - shm_before)
    text = log.read_text(errors="replace")
    result = {"when": when, "target": target, "delay": round(delay, 2), "reached": reached, "exit": code,
              "left": left, "shm": shm, "survivors": survivors, "log": str(log),
              "reached_step": "] 1/" in text, "finished": "total time" in text}
    if not args.keep:
        shutil.rmtree(top, ignore_errors=True)
        if not left and not shm:
            log.unlink()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20, help="runs per (when, target) pair")
    ap.add_argument("--when", default="build,step,end",
                    help="comma-separated: none (no signal), start, make, build, step, end")
    ap.add_argument("--dead-files", type=int, default=20000, help="files of the dead run's directories (make)")
    ap.add_argument("--target", default="torchrun,workers", help="comma-separated: torchrun, workers, both")
    ap.add_argument("--params", default="25M")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--jitter", type=float, default=3.0, help="seconds of random delay after the marker")
    ap.add_argument("--code", type=Path, default=ROOT, help="checkout of parts to run")
    ap.add_argument("--root", default=tempfile.gettempdir(), help="where the runs' directories go")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep each run's directory")
    args = ap.parse_args()
    args.code = args.code.resolve()
    rng = random.Random(args.seed)
    totals: dict[tuple[str, str], list[int]] = {}
    for when in args.when.split(","):
        for target in args.target.split(","):
            for k in range(args.runs):
                r = one_run(args, when, target, rng)
                dirty = bool(r["left"] or r["shm"] or r["survivors"])
                count = totals.setdefault((when, target), [0, 0])
                count[0] += dirty
                count[1] += 1
                print(f"{when:5} {target:8} run {k + 1:2}: +{r['delay']:5.2f}s exit {r['exit']} "
                      f"step reached {r['reached_step']} finished {r['finished']}: "
                      f"left {r['left'] or 'nothing'}"
                      + (f" /dev/shm {r['shm']}" if r["shm"] else "")
                      + (f" survivors {r['survivors']}" if r["survivors"] else "")
                      + (f" (log {r['log']})" if dirty else ""), flush=True)
    for (when, target), (dirty, n) in totals.items():
        print(f"{when} / {target}: {dirty} of {n} runs left something", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
