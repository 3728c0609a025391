"""Run by test_offload_memory.py in a fresh process: peak RSS growth of an offloaded run vs its bound.

A fresh process, because peak RSS is a process high-water mark and the allocator setting
(freed large buffers go back to the OS at once) must not leak into the test workers.
Prints one line: ``growth bound states`` in bytes. A second argument ``in-backward`` steps the
optimizer during backward (``step_in_backward``: reads ahead, landed grads and writes in flight,
a window each, and the shards kept loaded for the next forward).

``PATH sweep offload|memory WIDTH:L1,L2 ...``: the width sweep, one ``width layers growth bound``
line per run; no allocator setting of its own (an offloaded run's store sets what it needs, an
in-memory run keeps glibc's defaults, as a user's would).
"""

import contextlib
import gc
import sys
import warnings

warnings.filterwarnings("ignore", "Failed to initialize NumPy")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from parts.observe import reset_peak_memory, set_mmap_threshold, snapshot, trim_allocator  # noqa: E402
from parts.offload import DiskStore, OffloadBudget, OffloadedOptimizer, memory_bound  # noqa: E402
from parts.offload.plan import min_budget, split_budget  # noqa: E402
from parts.partition import attach, detach, partitioned, shards  # noqa: E402

D, LAYERS, ROWS = 512, 64, 8
LAYER = D * D + D
KNOBS = dict(prefetch_bucket_size=LAYER, max_live_parameters=2 * LAYER, persistence_threshold=D,
             reduce_bucket_size=LAYER, max_reuse_distance=0)
STORE = dict(threads=2, block_bytes=1 << 20, max_inflight_bytes=4 << 20, reuse_bytes=4 << 20)
CHUNK = 4 << 20


class Block(nn.Module):
    def __init__(self, width: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def warm_up() -> None:
    """Imports and one-time allocations every run pays (torch._dynamo at a first optimizer step)."""
    w = nn.Parameter(torch.ones(3))
    w.grad = torch.ones(3)
    torch.optim.AdamW([w]).step()


def main(path: str, in_backward: bool) -> None:
    torch.set_num_threads(1)
    set_mmap_threshold(128 * 1024)
    warm_up()
    store = DiskStore(path, **STORE)
    x = torch.randn(ROWS, D)
    base = snapshot().rss_bytes
    reset_peak_memory()
    with partitioned(remote_device=store):
        model = nn.Sequential(*[Block() for _ in range(LAYERS)])
    attach(model, **KNOBS)
    opt = OffloadedOptimizer(torch.optim.AdamW(shards(model), lr=1e-3), store, chunk_bytes=CHUNK)
    for _ in range(3):
        loss = model(x).square().mean()
        with opt.step_in_backward() if in_backward else contextlib.nullcontext():
            loss.backward()
        opt.step()
        opt.zero_grad()
    growth = snapshot().peak_rss_bytes - base
    detach(model)
    store.close()
    budget = OffloadBudget(itemsize=4, world_size=1, chunk_bytes=CHUNK, store_threads=STORE["threads"],
                           block_bytes=STORE["block_bytes"], max_inflight_bytes=STORE["max_inflight_bytes"],
                           reuse_bytes=STORE["reuse_bytes"],
                           read_ahead=2 * LAYER, largest_step_bytes=4 * 4 * D * D,
                           **{k: KNOBS[k] for k in ("max_live_parameters", "prefetch_bucket_size",
                                                    "reduce_bucket_size")})
    activations = 3 * ROWS * D * LAYERS * 4  # per block: linear out, tanh out, residual sum (fp32)
    print(growth, memory_bound(budget, activations), 16 * LAYERS * LAYER)


# ------------------------------------------------------------------ the width sweep
def sweep_budget(width: int) -> int:
    """The budget of a sweep run at ``width``: the smallest that holds one layer's step."""
    return min_budget(16 * width * width + 16 * width, 4, 8 << 20)


def sweep_bound(width: int, layers: int) -> int:
    """``memory_bound`` of a sweep run: its budget's knobs, one layer's step, its activations."""
    split = split_budget(sweep_budget(width), 4, 8 << 20)
    knobs = split.attach_knobs(4)
    budget = OffloadBudget(itemsize=4, world_size=1, chunk_bytes=split.chunk_bytes, store_threads=4,
                           block_bytes=split.block_bytes, max_inflight_bytes=split.max_inflight_bytes,
                           reuse_bytes=split.reuse_bytes, read_ahead=2 * knobs["prefetch_bucket_size"],
                           largest_step_bytes=16 * width * width, **knobs)
    return memory_bound(budget, 3 * ROWS * width * layers * 4)


def sweep_run(path: str, offloaded: bool, width: int, layers: int) -> int:
    """Peak RSS growth (bytes) of a run of ``layers`` blocks of ``width``, offloaded or in memory,
    with every window sized by the same budget; steps during backward when offloaded."""
    gc.collect()
    trim_allocator()
    split = split_budget(sweep_budget(width), 4, 8 << 20)
    store = DiskStore(path, memory_budget=split.memory_budget) if offloaded else None
    x = torch.randn(ROWS, width)
    base = snapshot().rss_bytes
    reset_peak_memory()
    with partitioned(remote_device=store):
        model = nn.Sequential(*[Block(width) for _ in range(layers)])
    attach(model, persistence_threshold=width, max_reuse_distance=0, **split.attach_knobs(4))
    inner = torch.optim.AdamW(shards(model), lr=1e-3)
    opt = OffloadedOptimizer(inner, store) if offloaded else inner
    for _ in range(2):
        loss = model(x).square().mean()
        with opt.step_in_backward() if offloaded else contextlib.nullcontext():
            loss.backward()
        opt.step()
        opt.zero_grad()
    growth = snapshot().peak_rss_bytes - base
    detach(model)
    if store is not None:
        store.close()
    return growth


def sweep(path: str, offloaded: bool, specs: list[str]) -> None:
    """Print ``width layers growth bound`` for each ``WIDTH:L1,L2,...`` of ``specs``."""
    torch.set_num_threads(1)
    warm_up()
    for spec in specs:
        width, depths = spec.split(":")
        for layers in map(int, depths.split(",")):
            growth = sweep_run(path, offloaded, int(width), layers)
            print(width, layers, growth, sweep_bound(int(width), layers), flush=True)


if __name__ == "__main__":
    if sys.argv[2] == "sweep":
        sweep(sys.argv[1], sys.argv[3] == "offload", sys.argv[4:])
    else:
        main(sys.argv[1], sys.argv[2:] == ["in-backward"])
