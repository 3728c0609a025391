"""Run by test_offload_memory.py in a fresh process: peak RSS growth of an offloaded run vs its bound.

A fresh process, because peak RSS is a process high-water mark and the allocator setting
(freed large buffers go back to the OS at once) must not leak into the test workers.
Prints one line: ``growth bound states`` in bytes. A second argument ``in-backward`` steps the
optimizer during backward (``step_in_backward``: reads ahead, landed grads and writes in flight,
a window each, and the shards kept loaded for the next forward).
"""

import contextlib
import sys
import warnings

warnings.filterwarnings("ignore", "Failed to initialize NumPy")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from parts.observe import reset_peak_memory, set_mmap_threshold, snapshot  # noqa: E402
from parts.offload import DiskStore, OffloadBudget, OffloadedOptimizer, memory_bound  # noqa: E402
from parts.partition import attach, detach, partitioned, shards  # noqa: E402

D, LAYERS, ROWS = 512, 64, 8
LAYER = D * D + D
KNOBS = dict(prefetch_bucket_size=LAYER, max_live_parameters=2 * LAYER, persistence_threshold=D,
             reduce_bucket_size=LAYER, max_reuse_distance=0)
STORE = dict(threads=2, block_bytes=1 << 20, max_inflight_bytes=4 << 20, reuse_bytes=4 << 20)
CHUNK = 4 << 20


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] == ["in-backward"])
