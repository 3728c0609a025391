"""Run by test_launch.py under ``torchrun --max-restarts``: a loop of all-reduces whose rank 1
SIGKILLs itself at step 5 of the first start. ``plain`` starts the group with
``torch.distributed.init_process_group``, ``parts`` with ``parts.comm.init_process_group``.
Each rank prints ``start <n> rank <r> done <sum>`` once its loop ends. The group's timeout is
20 s, so a start that cannot connect fails instead of waiting for 30 minutes."""

import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from parts.comm import init_process_group

(init_process_group if sys.argv[1] == "parts" else dist.init_process_group)("gloo", timeout=timedelta(seconds=20))
rank, start = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
total = torch.zeros(1)
for step in range(10):
    one = torch.ones(1)
    dist.all_reduce(one)
    total += one
    if step == 5 and rank == 1 and start == 0:
        os.kill(os.getpid(), signal.SIGKILL)
print(f"start {start} rank {rank} done {total.item():.0f}", flush=True)
dist.destroy_process_group()
