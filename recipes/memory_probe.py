"""Memory probe: a stack of Linear layers built replicated and built sharded, side by side.

    torchrun --standalone --nproc-per-node 2 recipes/memory_probe.py
    torchrun --standalone --nproc-per-node 2 recipes/memory_probe.py --hidden-dim 2048 --dtype fp32
    torchrun --standalone --nproc-per-node 2 recipes/memory_probe.py --device cuda   # parameters on a GPU per rank

The same ``--nlayers`` x ``Linear(hidden, hidden)`` model is built twice: plainly (every rank
holds all Ψ parameters) and inside ``partitioned()`` (each rank keeps a 1/N shard, so
building never holds more than one layer in full). ``memory_usage(force=True)`` reports RSS
before the build, after it and after ``--forwards`` no-grad forwards (the sharded model is
fetched layer by layer by ``attach``, or by ``gathered`` per layer with ``--fetch gathered``).
The table compares each rank's parameter bytes (distinct storages, ``storage_bytes``) with
the ZeRO-3 formula: bytes-per-element x Ψ / N (x Ψ when replicated).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc

import torch
import torch.distributed as dist
from torch import nn

import devices
from parts.comm import all_gather_objects
from parts.observe import memory_usage, storage_bytes
from parts.partition import gathered, is_partitioned, meta, partitioned

try:
    from parts.partition import attach, detach
except ImportError:  # until the package re-exports the coordinator
    from parts.partition.coordinator import attach, detach

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args() -> argparse.Namespace:
    """Command-line knobs (defaults run in a few seconds on 2 CPU ranks)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nlayers", type=int, default=78)
    ap.add_argument("--hidden-dim", type=int, default=512)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--batch", type=int, default=4, help="rows per forward")
    ap.add_argument("--forwards", type=int, default=2)
    ap.add_argument("--fetch", choices=("attach", "gathered"), default="attach",
                    help="how the sharded model gets its full weights for a forward")
    devices.add_device_flag(ap)
    return ap.parse_args()


def release_free_heap() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc), so RSS shows live memory."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)


def build(args: argparse.Namespace, sharded: bool) -> nn.Sequential:
    """The layer stack, sharded at construction when ``sharded``."""
    dtype = DTYPES[args.dtype]
    device = devices.pick(args.device)
    with partitioned(dtype=dtype, device=device, enabled=sharded):
        model = nn.Sequential(*(nn.Linear(args.hidden_dim, args.hidden_dim) for _ in range(args.nlayers)))
    return model if sharded else model.to(device, dtype)  # built in fp32 like the sharded one, then cast


def param_bytes(model: nn.Module) -> int:
    """Bytes of parameter storage this rank holds: full tensors plus shards, each storage once."""
    held = [p for p in model.parameters()]
    held += [meta(p).shard for p in model.parameters() if is_partitioned(p)]
    return storage_bytes(held)


@torch.no_grad()
def run_forwards(model: nn.Sequential, args: argparse.Namespace, sharded: bool) -> None:
    """``--forwards`` passes over a fixed input; sharded weights are fetched per layer."""
    x = torch.randn(args.batch, args.hidden_dim, generator=torch.Generator().manual_seed(0))
    x = x.to(devices.pick(args.device), DTYPES[args.dtype])
    coordinator = attach(model) if sharded and args.fetch == "attach" else None
    for _ in range(args.forwards):
        y = x
        for layer in model:
            if sharded and coordinator is None:
                with gathered(layer.parameters()):
                    y = layer(y)
            else:
                y = layer(y)
    if coordinator is not None:
        detach(coordinator)


def warm_up(args: argparse.Namespace) -> None:
    """Run every code path once on a tiny model, so first-use costs (lazy imports, gloo buffers)
    land before the first measurement instead of in the first model's numbers."""
    tiny = argparse.Namespace(**{**vars(args), "nlayers": 2, "hidden_dim": 8, "forwards": 1})
    for sharded in (True, False):
        run_forwards(build(tiny, sharded), tiny, sharded)


def probe(args: argparse.Namespace, sharded: bool) -> list[tuple]:
    """Build, measure, run forwards, measure; one row (per phase) of every rank's numbers."""
    mode = "partitioned" if sharded else "replicated"
    rows = []

    def measure(phase: str, model) -> None:
        release_free_heap()
        report = memory_usage(f"{mode}: {phase}", force=True)
        mine = (param_bytes(model) if model is not None else 0, report.rss_bytes)
        everyone = all_gather_objects(mine)
        rows.append((mode, phase, everyone))

    measure("pre-init", None)
    model = build(args, sharded)
    measure("post-init", model)
    run_forwards(model, args, sharded)
    measure(f"after {args.forwards} forwards", model)
    del model
    return rows


def main() -> None:
    args = parse_args()
    devices.init(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    warm_up(args)
    torch.manual_seed(1234)
    rows = probe(args, sharded=True) + probe(args, sharded=False)
    numel = args.nlayers * (args.hidden_dim ** 2 + args.hidden_dim)
    itemsize = DTYPES[args.dtype].itemsize
    if rank == 0:
        print(f"\n{args.nlayers} x Linear({args.hidden_dim}, {args.hidden_dim}) in {args.dtype}: "
              f"Ψ = {numel:,} parameters, N = {world} ranks, {itemsize} bytes each")
        header = (f"{'model':<12} {'phase':<18} {'formula MiB':>11} "
                  + " ".join(f"{f'params r{r} MiB':>15}" for r in range(world))
                  + " " + " ".join(f"{f'RSS r{r} MiB (+built)':>22}" for r in range(world)))
        print(header + "\n" + "-" * len(header))
        for i, (mode, phase, everyone) in enumerate(rows):
            base = rows[i - i % 3][2]  # this model's pre-init row
            share = world if mode == "partitioned" else 1
            expected = 0 if phase == "pre-init" else itemsize * numel / share
            print(f"{mode:<12} {phase:<18} {expected / 2**20:>11.2f} "
                  + " ".join(f"{b / 2**20:>15.2f}" for b, _ in everyone)
                  + " " + " ".join(f"{r / 2**20:>13.1f} ({(r - b) / 2**20:+6.1f})"
                                   for (_, r), (_, b) in zip(everyone, base)))
        print("formula: ZeRO-3 params = bytes x Ψ / N (replicated: bytes x Ψ); "
              "measured params include shard padding;\n"
              "RSS is the whole process after malloc_trim, (+built) its growth since that model's pre-init")
    dist.barrier()  # no rank tears its connections down while another still works
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
