"""The main recipe's resilience flags: ``--snapshot-every K`` (host-memory snapshots that the
workers torchrun's agent restarts continue from) and ``--heartbeat`` (a dead or hung peer named
within seconds), and the test-only failure injection the kill test and benchmark use.

Test-only, read from the environment of the first start of the workers only
(``TORCHELASTIC_RESTART_COUNT`` 0 or unset):

- ``PARTS_RECIPE_FAIL="kind:rank:step"``: rank ``rank`` fails right after optimizer step
  ``step``: ``kill`` (SIGKILL itself), ``stop`` (SIGSTOP itself: a hang) or ``raise`` (a
  ``RuntimeError``).
- ``PARTS_RECIPE_EVENTS=FILE``: each rank appends JSON lines to FILE: its start, the failure,
  the restore and the first step after it, each with a wall-clock time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import time
from typing import Any, Optional

import torch

from parts.comm import Heartbeat, Snapshots

# A snapshot of the default model costs about 40 ms of loop time per save on 2 CPU ranks
# (benchmarks/bench_kill.py measures it): every 25 steps keeps it under 5% of the step time.
SNAPSHOT_EVERY = 25


def add_flags(add: Any) -> None:
    """``--snapshot-every [K]`` and ``--heartbeat`` (``add``: the parser's ``add_argument``)."""
    add("--snapshot-every", type=int, nargs="?", const=SNAPSHOT_EVERY, default=0, metavar="K",
        help=f"every K steps a snapshot of the training state in host memory (/dev/shm); the same command "
             f"line rerun by torchrun's agent after a failure continues from the newest one "
             f"(the flag alone: K={SNAPSHOT_EVERY}; 0: off)")
    add("--heartbeat", action="store_true",
        help="name a dead or hung rank within seconds and end every rank (parts.comm.Heartbeat)")


def first_start() -> bool:
    """True in the first start of the workers (not a restart by torchrun's agent)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0


def note(event: str, **values: Any) -> None:
    """Append ``event`` to ``PARTS_RECIPE_EVENTS`` (test-only), with the rank, the restart count and the time."""
    path = os.environ.get("PARTS_RECIPE_EVENTS")
    if path:
        record = {"event": event, "time": time.time(), "rank": int(os.environ.get("RANK", "0")),
                  "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), **values}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def inject(step: int, rank: int) -> None:
    """Fail as ``PARTS_RECIPE_FAIL`` says (test-only; the first start only)."""
    spec = os.environ.get("PARTS_RECIPE_FAIL")
    if not spec or not first_start():
        return
    kind, at_rank, at_step = spec.split(":")
    if (int(at_rank), int(at_step)) != (rank, step):
        return
    note("fail", kind=kind, step=step)
    if kind == "raise":
        raise RuntimeError(f"PARTS_RECIPE_FAIL: rank {rank} raises after step {step}")
    os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)


def snapshots(args: argparse.Namespace) -> Optional[Snapshots]:
    """The run's ``Snapshots`` with ``--snapshot-every``, else None."""
    return Snapshots(args.snapshot_every).start() if args.snapshot_every else None


def restore(snaps: Optional[Snapshots], state: dict, generator: torch.Generator) -> Optional[int]:
    """Load the newest snapshot into ``state`` and ``generator``; the step it holds, or None."""
    if snaps is None:
        return None
    restored = snaps.restore(state)
    if restored is None:
        return None
    if restored.local is not None:
        generator.set_state(restored.local["data"])
    note("restored", step=restored.step, seconds=restored.seconds, disk_bytes=restored.disk_bytes,
         generation=restored.generation, folder=str(snaps.job_dir))
    return restored.step


def heartbeat(args: argparse.Namespace) -> Any:
    """``Heartbeat()`` with ``--heartbeat``, else a context that does nothing."""
    return Heartbeat() if args.heartbeat else contextlib.nullcontext()
