"""Run by test_reliability_exit.py under torchrun: a short parts training run, then
``destroy_process_group``; exits 3 if gloo's threads outlive the process group (issue 21 row 3).

Before the fix, an attached model and its optimizer formed reference cycles through C++ hooks
(and a lookup whose values held its keys) that Python never freed: the process group and its
gloo threads ran on through interpreter teardown, where exit sometimes aborted with
``terminate called without an active exception``.
"""

import gc
import os
import sys
import warnings
from datetime import timedelta

warnings.filterwarnings("ignore", "Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parts.optim import BF16Optimizer  # noqa: E402
from parts.partition import attach, full_state_dict, partitioned  # noqa: E402


def native_threads() -> list[str]:
    """Names of this process's OS threads (gloo's are pt_gloo_runloop and gloo_tcp_loop)."""
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))


def train() -> None:
    """Attach, two steps of BF16Optimizer, a consolidated state dict: every parts collective kind."""
    torch.manual_seed(0)
    with partitioned():
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    attach(model, persistence_threshold=0)
    optimizer = BF16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), allow_fp32=True)
    for _ in range(2):
        model(torch.randn(8, 32)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    full_state_dict(model)
    optimizer.consolidated_state_dict()


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    train()
    gc.collect()
    dist.destroy_process_group()
    left = [name for name in native_threads() if "gloo" in name]
    print(f"rank {os.environ.get('RANK')}: gloo threads after destroy_process_group: {left}", flush=True)
    sys.exit(3 if left else 0)


if __name__ == "__main__":
    main()
