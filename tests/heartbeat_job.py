"""Run by test_heartbeat.py as every rank of a job: a loop of all-reduces under ``Heartbeat()``
(default knobs; ``keep`` as the second argument: ``end_stopped=False``), in which rank 1
misbehaves at step 20 (``sigkill`` or ``sigstop``). A rank that raises ``PeerFailure`` prints
``PEER FAILURE <json>`` before the error ends it."""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from parts.comm import Heartbeat, PeerFailure


def misbehave(kind: str) -> None:
    """Rank 1's step 20: its heartbeat reports it here, then it is killed or stopped."""
    time.sleep(1.5)
    print(f"rank 1 misbehaves at {time.time()}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP)


kind = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
try:
    with Heartbeat(end_stopped=sys.argv[2:] != ["keep"]) as beat:
        for step in range(10_000):
            beat.at_step(step)
            if rank == 1 and step == 20:
                misbehave(kind)
            dist.all_reduce(torch.ones(4))
            time.sleep(0.05)
except PeerFailure as failure:
    sys.stdout.write("PEER FAILURE " + json.dumps({"rank": rank, "failed": failure.rank, "step": failure.step,
                                                   "op": failure.op, "time": time.time()}) + "\n")
    sys.stdout.flush()  # one write: the other ranks' lines never split it
    raise
