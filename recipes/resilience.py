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
import socket
import statistics
import threading
import time
from typing import Any, Iterator, Optional

import torch

from parts.comm import Heartbeat, Snapshots, all_gather_objects

# A snapshot of the default model holds the loop ~70 ms and takes ~140 ms of CPU in its
# background thread at world 2 on 2 cores (benchmarks/bench_kill.py): every 25 steps costs
# ~2.5% of the step time (at most ~3.6% if the thread's CPU time all came out of the steps).
SNAPSHOT_EVERY = 25


def add_flags(add: Any) -> None:
    """``--snapshot-every [K]``, ``--snapshot-root``, ``--snapshot-job`` and ``--heartbeat``
    (``add``: the parser's ``add_argument``)."""
    add("--snapshot-every", type=int, nargs="?", const=SNAPSHOT_EVERY, default=0, metavar="K",
        help=f"every K steps a snapshot of the training state in host memory (/dev/shm); the same command "
             f"line rerun by torchrun's agent after a failure continues from the newest one "
             f"(the flag alone: K={SNAPSHOT_EVERY}; 0: off)")
    add("--snapshot-root", default=None, metavar="DIR",
        help="the folder of the snapshots (default /dev/shm); the ranks of one node must see the same one, "
             "and nodes that do not see node 0's send their buddy copies over the network")
    add("--snapshot-job", default=None, metavar="NAME",
        help="the snapshots' job name (default: torchrun's run id); a relaunch with the same name and "
             "root continues from them")
    add("--heartbeat", action="store_true",
        help="name a dead or hung rank within seconds and end every rank (parts.comm.Heartbeat); a stopped "
             "rank on this host is sent SIGKILL, so that torchrun's agent restarts at once")


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


_TICKS: list[float] = []  # with PARTS_RECIPE_EVENTS: the time at each step's end (test-only)


def tick() -> None:
    """Note the end of a step (the loop's start first), with ``PARTS_RECIPE_EVENTS`` only."""
    if os.environ.get("PARTS_RECIPE_EVENTS"):
        _TICKS.append(time.perf_counter())


def step_times() -> dict:
    """The median step and the time the steps took beyond ``steps x`` their median, from ``tick``."""
    steps = [b - a for a, b in zip(_TICKS, _TICKS[1:])]
    if not steps:
        return {}
    median = statistics.median(steps)
    return {"median_step": median, "beyond_median": sum(steps) - median * len(steps)}


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
    if not args.snapshot_every:
        return None
    return Snapshots(args.snapshot_every, job=args.snapshot_job, root=args.snapshot_root).start()


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
         fetched_bytes=restored.fetched_bytes, network=snaps.network, generation=restored.generation,
         folder=str(snaps.job_dir))
    return restored.step


@contextlib.contextmanager
def heartbeat(args: argparse.Namespace) -> Iterator[Optional[Heartbeat]]:
    """With ``--heartbeat``: ``Heartbeat()`` (which itself sends SIGKILL to a peer of this host
    it sees stopped), and a peer on this host that stopped beating while it runs (hung) is sent
    SIGKILL once it is named, so that torchrun's agent restarts the group at once instead of
    waiting 30 s for the worker to answer its SIGTERM. Without the flag: nothing (None)."""
    if not args.heartbeat:
        yield None
        return
    peers = all_gather_objects((socket.gethostname(), os.getpid()))
    ended = threading.Event()
    with Heartbeat() as beat:
        threading.Thread(target=_end_stopped_peer, args=(beat, peers, ended), name="recipe-stopped-peer",
                         daemon=True).start()
        try:
            yield beat
        finally:
            ended.set()


def _end_stopped_peer(beat: Heartbeat, peers: list, ended: threading.Event) -> None:
    """SIGKILL the rank ``beat`` names once it sent no heartbeat for the timeout (hung), if it
    runs on this host (one seen stopped is ended by the heartbeat, once every rank was told)."""
    while beat.failure is None:
        if ended.wait(0.1):
            return
    failure = beat.failure
    if failure.reason.startswith("sent no heartbeat") and 0 <= failure.rank < len(peers):
        host, pid = peers[failure.rank]
        if host == socket.gethostname() and pid != os.getpid():
            note("ended stopped peer", peer=failure.rank)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
