"""Run by test_reliability_exit.py under torchrun: a short parts training run, then
``destroy_process_group``; exits 3 if gloo's threads outlive the process group.

``keep`` (the user's shape): the model, coordinator and optimizer are still alive at
``destroy_process_group`` (no ``del``, no ``gc.collect()``), right after a collective. A parts
object holding the group strongly would keep the group and its gloo workers alive into
interpreter teardown, where a worker still releasing the last collective's tensors takes the
GIL, is ended by ``pthread_exit`` and aborts the process (``terminate called without an
active exception``). parts holds groups weakly, so ``destroy_process_group`` joins them.

``drop``: the objects are dropped and collected before ``destroy_process_group``; exits 4 if
one is never freed (a reference cycle through a hook held in C++ would keep it).

``both``: ``drop``, then ``keep`` with a second model, coordinator and optimizer in the same
process: both checks for the cost of one launch.

``exit``: train, then end without ``destroy_process_group``, as the README's loop does; an exit
handler registered before parts is imported (so it runs after parts' own) exits 3 if gloo's
threads are still there when the interpreter goes on to finalize.
"""

import atexit
import gc
import os
import sys
import warnings
import weakref
from datetime import timedelta


def _at_exit() -> None:
    """``exit`` mode: the gloo threads left after every exit handler; exit 3 if any."""
    if sys.argv[1:] == ["exit"]:
        left = [name for name in native_threads() if "gloo" in name]
        print(f"rank {os.environ.get('RANK')} (exit): gloo threads at interpreter exit: {left}", flush=True)
        if left:
            os._exit(3)


atexit.register(_at_exit)  # before parts registers its own: runs after it

warnings.filterwarnings("ignore", "Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parts.optim import BF16Optimizer  # noqa: E402
from parts.partition import attach, full_state_dict, partitioned  # noqa: E402


def native_threads() -> list[str]:
    """Names of this process's OS threads (gloo's are pt_gloo_runloop and gloo_tcp_loop)."""
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))


def train() -> tuple:
    """Attach, two steps of BF16Optimizer, a consolidated state dict: every parts collective
    kind, the last one just before returning. Returns (model, coordinator, optimizer)."""
    torch.manual_seed(0)
    with partitioned():
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    coordinator = attach(model, persistence_threshold=0)
    optimizer = BF16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), allow_fp32=True)
    for _ in range(2):
        model(torch.randn(8, 32)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    full_state_dict(model)
    optimizer.consolidated_state_dict()
    return model, coordinator, optimizer


def report(mode: str) -> int:
    """Print the gloo threads left after ``destroy_process_group``; 3 if any."""
    left = [name for name in native_threads() if "gloo" in name]
    print(f"rank {os.environ.get('RANK')} ({mode}): gloo threads after destroy_process_group: {left}", flush=True)
    return 3 if left else 0


def drop() -> list[str]:
    """Train, drop the model, coordinator and optimizer, collect: the names of those never freed."""
    refs = [weakref.ref(obj) for obj in train()]
    gc.collect()
    return [type(ref()).__name__ for ref in refs if ref() is not None]


def main(mode: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    if mode == "exit":
        kept = train()  # noqa: F841 - alive at exit, as a script's globals are
        return
    leaked = drop() if mode in ("drop", "both") else []
    if leaked:
        print(f"rank {os.environ.get('RANK')}: never freed: {leaked}", flush=True)
    if mode != "drop":
        model, coordinator, optimizer = train()
    dist.destroy_process_group()
    sys.exit(report(mode) or (4 if leaked else 0))  # keep: model, coordinator and optimizer still alive here


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "keep")
