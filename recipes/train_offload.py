"""Train a GPT whose model states do not fit this machine: ZeRO-3 with shards and Adam state on disk.

    torchrun --standalone --nproc-per-node 2 recipes/train_offload.py                 # 1.7B params
    torchrun --standalone --nproc-per-node 2 recipes/train_offload.py --params 350M --steps 8
    torchrun --standalone --nproc-per-node 1 recipes/train_offload.py --memory-budget-gib 5  # one process
    torchrun --standalone --nproc-per-node 1 recipes/train_offload.py --device cuda  # GPU compute, states on disk

Every rank keeps its parameter shards, their grads and AdamW's two moments in a
``parts.offload.DiskStore`` (scratch files under ``--store``, printed at start, removed at exit
or on SIGTERM; a later run reclaims the ones a killed run left): the model is
built under ``partitioned(remote_device=store)`` (each module's shards go to disk right after
its ``__init__``), ``attach`` gathers two blocks at most, reading shards ahead along its
trace, and ``OffloadedOptimizer(AdamW)`` steps each parameter during backward, as soon as
its grad shard lands (``step_in_backward``: shard and moments read ahead, stepped, written
back while backward computes the layers below; the grads never go to disk). fp32
throughout; data: the standard library's Python sources.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import time

import torch
import torch.distributed as dist

import devices
import report
from chardata import VOCAB_SIZE, batch, load_splits
from gpt_model import GPT, GPTConfig
from offload_timing import CommTimer
from parts.comm import all_gather_objects, broadcast_object
from parts.observe import snapshot
from parts.offload import DiskStore, OffloadBudget, OffloadedOptimizer, memory_bound
from parts.partition import attach, partitioned, shards

PRESETS = {  # name: (n_layer, n_embd, n_head); parameters about 12 * n_layer * n_embd**2
    "25M": (8, 512, 8), "125M": (12, 896, 14), "350M": (28, 1024, 16), "760M": (27, 1536, 16),
    "1.7B": (34, 2048, 16),
}
GiB = 2**30


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every flag's default."""


def parse_args() -> argparse.Namespace:
    """Flags; the defaults train the 1.7B model for a few steps in under 15 minutes on 2 cores."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    add = ap.add_argument
    add("--params", choices=sorted(PRESETS, key=lambda k: PRESETS[k][0] * PRESETS[k][1] ** 2), default="1.7B",
        help="model size (parameters)")
    add("--store", default="/tmp/parts-offload", help="directory of the per-rank scratch stores")
    add("--seq-len", type=int, default=16, help="tokens per sequence")
    add("--batch-size", type=int, default=1, help="sequences per rank per step")
    add("--steps", type=int, default=4, help="optimizer steps")
    add("--lr", type=float, default=None, help="peak LR; None: lr_for(model), scaled to width x depth")
    add("--warmup", type=int, default=3, help="steps of linear LR warm-up (Adam's first steps are sign steps)")
    add("--in-memory", action="store_true", help="shards and state in memory (a comparison at small --params)")
    add("--after-backward", action="store_true",
        help="step the offloaded optimizer after backward (grads to disk and back), not during it")
    add("--seed", type=int, default=1234, help="seed of the weights and the batches")
    add("--same-batch", action="store_true",
        help="train every step on step 1's batch (its loss then falls step by step: the optimizer learns)")
    add("--memory-budget-gib", type=float, default=None,
        help="memory per rank the store's windows, the optimizer chunk and the coordinator's live budget "
             "are sized from; None: DiskStore's default (a share of the available memory per local rank)")
    add("--chunk-mib", type=int, default=None,
        help="optimizer chunk (parameter + grad + state bytes); None: the budget's")
    add("--io-threads", type=int, default=4, help="IO threads per rank's store")
    add("--inflight-mib", type=int, default=None,
        help="cap on bytes of store transfers outstanding; None: the budget's")
    devices.add_device_flag(ap)
    return ap.parse_args()


def config_of(args: argparse.Namespace) -> GPTConfig:
    layers, width, heads = PRESETS[args.params]
    return GPTConfig(vocab_size=VOCAB_SIZE, block_size=args.seq_len, n_layer=layers, n_head=heads,
                     n_embd=width)


def count_params(c: GPTConfig) -> int:
    """Parameters of ``gpt_model.GPT`` with config ``c`` (without building it)."""
    d = c.n_embd
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return (c.vocab_size + c.block_size) * d + c.n_layer * block + 2 * d


def disk_bytes(psi: int, in_backward: bool) -> int:
    """Peak bytes of the stores: fp32 values, grads and two moments (16 Psi); stepping during
    backward no grad goes to disk, but the new values and moments are staged beside the old
    ones until the step commits (24 Psi)."""
    return (24 if in_backward else 16) * psi


def arithmetic(psi: int, world: int, ram: int, disk: int) -> list[tuple[str, str]]:
    """Model-state bytes (ZeRO paper, mixed-precision-free fp32 AdamW: 16 bytes a parameter) on
    this one machine, where all ``world`` ranks share ``ram``; ``disk``: the stores' peak."""
    rows = [("parameters (Psi)", f"{psi / 1e9:.2f} B"), ("RAM of this machine", f"{ram / GiB:.1f} GiB")]
    for name, per_rank in [("DDP (16 Psi per rank)", 16 * psi),
                           ("ZeRO-1/2 (4 Psi + 12 Psi/N)", 4 * psi + 12 * psi // world),
                           ("FSDP2 / ZeRO-3 in memory (16 Psi/N)", 16 * psi // world)]:
        total = per_rank * world
        rows.append((name, f"{total / GiB:.1f} GiB on this machine: "
                           f"{'does not fit' if total > ram else 'fits'}"))
    rows.append(("parts.offload (on disk)", f"{disk / GiB:.1f} GiB of files at most; memory: ~2 blocks"))
    return rows


def lr_for(c: GPTConfig) -> float:
    """Default peak LR: 1e-5 at the 350M preset (28 x 1024), scaled by 1 / (n_embd * n_layer).

    Adam's first steps move every weight by about lr (sign steps), so one step shifts the
    residual stream by about lr * n_embd * n_layer (fan-in times layers, coherently), while
    the stream itself starts at the embeddings' scale (std 0.02) whatever the size: a
    fixed lr that trains 350M overshoots at 1.7B (loss 5.77 -> 10.59 at lr 1e-5, 125M at
    1e-4 likewise, in memory and on disk alike). Keeping lr * n_embd * n_layer fixed keeps
    the first steps' relative change the same."""
    return 1e-5 * (28 * 1024) / (c.n_layer * c.n_embd)


def check_disk(path: str, need: int) -> None:
    """Refuse to start if the store's file system lacks ``need`` bytes (plus 10%)."""
    os.makedirs(path, exist_ok=True)
    free = shutil.disk_usage(path).free
    if free < need * 1.1:
        raise SystemExit(f"train_offload: the stores need {need / GiB:.1f} GiB under {path}, "
                         f"only {free / GiB:.1f} GiB are free (df -h {path}); pass --store elsewhere "
                         f"or a smaller --params")


def live_knobs(config: GPTConfig, store: DiskStore) -> dict[str, int]:
    """The coordinator's knobs from the store's budget, but a block prefetched and two gathered at
    least (a block's weights are used together)."""
    layer = 12 * config.n_embd ** 2
    knobs = store.budget.attach_knobs(4)
    return dict(prefetch_bucket_size=max(knobs["prefetch_bucket_size"], layer),
                max_live_parameters=max(knobs["max_live_parameters"], 2 * layer),
                reduce_bucket_size=max(knobs["reduce_bucket_size"], layer))


def agreed_knobs(config: GPTConfig, store: DiskStore) -> dict[str, int]:
    """``live_knobs`` the same on every rank (each knob's least over the ranks: a default budget is
    a share of the memory available when each rank looked, and ``attach`` refuses knobs that differ)."""
    every = all_gather_objects(live_knobs(config, store))
    return {name: min(knobs[name] for knobs in every) for name in every[0]}


def knobs_bound(config: GPTConfig, store: DiskStore, world: int, knobs: dict[str, int]) -> int:
    """``plan.memory_bound`` of the knobs this run uses (activations aside): bytes above a rank's baseline."""
    b = store.budget
    largest = 16 * -(-4 * config.n_embd ** 2 // world)  # an MLP weight's shard: value, grad, two moments
    return memory_bound(OffloadBudget(
        knobs["max_live_parameters"], knobs["prefetch_bucket_size"], 4, world, b.chunk_bytes, store.threads,
        store.block_bytes, store.max_inflight_bytes, store.reuse.capacity, knobs["reduce_bucket_size"],
        read_ahead=2 * knobs["prefetch_bucket_size"], largest_step_bytes=largest))


def budget_rows(store: DiskStore, config: GPTConfig, world: int, knobs: dict[str, int]) -> list[tuple[str, str]]:
    """What the store's memory budget chose, and why; and whether the knobs' bound keeps within it."""
    b, bound = store.budget, knobs_bound(config, store, world, knobs)
    within = ("within the budget" if bound <= b.memory_budget else
              "above the budget: whole blocks in the coordinator's windows (one prefetched, two gathered, "
              "one reduced) and the largest parameter's step are floors its shares do not cover")
    return [("memory budget per rank", f"{b.memory_budget / GiB:.2f} GiB: {b.reason}"),
            ("  bound of these knobs", f"{bound / GiB:.2f} GiB above the baseline (plan.memory_bound, "
                                       f"activations aside): {within}"),
            ("  store", f"{store.max_inflight_bytes / 2**20:.0f} MiB in flight, {store.reuse.capacity / 2**20:.0f} MiB "
                        f"reuse pool, {store.threads} x {store.block_bytes / 2**20:.1f} MiB bounce blocks"),
            ("  host cache", f"{b.host_cache_bytes / 2**20:.0f} MiB at most of freed blocks of 1 MiB or more kept for "
                             f"reuse, within the peak of those in use (parts.csrc.host_cache)"),
            ("  optimizer chunk", f"{b.chunk_bytes / 2**20:.0f} MiB (three held: read, stepped, written)"),
            ("  coordinator", f"{knobs['max_live_parameters'] * 4 / 2**20:.0f} MiB gathered, "
                              f"{knobs['prefetch_bucket_size'] * 4 / 2**20:.0f} MiB prefetched "
                              f"(twice that read ahead from disk; at least two blocks)")]


def build(args: argparse.Namespace, store: DiskStore, knobs: dict[str, int]):
    torch.manual_seed(args.seed)
    config = config_of(args)
    with partitioned(device=devices.pick(args.device), remote_device=None if args.in_memory else store):
        model = GPT(config)
    attach(model, max_reuse_distance=0, persistence_threshold=4 * config.n_embd, **knobs)
    inner = torch.optim.AdamW(shards(model), lr=args.lr or lr_for(config), weight_decay=0.0)
    chunk = None if args.chunk_mib is None else args.chunk_mib << 20
    optimizer = inner if args.in_memory else OffloadedOptimizer(inner, store, chunk_bytes=chunk)
    warm = max(args.warmup, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm))
    return model, optimizer, schedule


def train_step(model, optimizer, schedule, tokens, gen, args) -> float:
    x, y = devices.to(devices.pick(args.device), *batch(tokens, args.batch_size, args.seq_len, gen))
    loss = model(x, y)
    in_backward = isinstance(optimizer, OffloadedOptimizer) and not args.after_backward
    with optimizer.step_in_backward() if in_backward else contextlib.nullcontext():
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    schedule.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


@torch.no_grad()
def batch_loss(model, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean over ranks of the loss on ``(x, y)``, without training (a forward in eval mode)."""
    model.eval()
    mean = model(x, y).detach().clone()
    model.train()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def line(step: int, total: int, loss: float, wall: float, io: dict, comm: float, rss: list) -> str:
    bar = "#" * (20 * step // total) + "." * (20 - 20 * step // total)
    compute = max(wall - io["wait"] - comm, 0.0)
    return (f"[{bar}] {step}/{total} loss {loss:.4f}  step {wall:.1f}s  compute {compute:.1f}s  "
            f"disk read {io['read_s']:.1f}s ({io['read'] / GiB:.1f} GiB)  disk write {io['write_s']:.1f}s "
            f"({io['write'] / GiB:.1f} GiB)  io wait {io['wait']:.1f}s  comm {comm:.1f}s  "
            f"RSS/rank {' '.join(f'{r / 2**20:.0f}' for r in rss)} MiB  disk {io['used'] / GiB:.1f} GiB/rank  "
            f"load {os.getloadavg()[0]:.1f}")


def io_delta(store: DiskStore, before) -> dict:
    d = store.stats.minus(before)
    return {"read": d.bytes_read, "write": d.bytes_written, "read_s": d.read_seconds / store.threads,
            "write_s": d.write_seconds / store.threads, "wait": d.wait_seconds, "used": store.used_bytes}


def main() -> None:
    args = parse_args()
    device = devices.init(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    psi = count_params(config_of(args))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if rank == 0:
        disk = disk_bytes(psi, not args.after_backward)
        print(report.table(arithmetic(psi, world, ram, disk)), flush=True)
        check_disk(args.store, disk)
    dist.barrier()
    budget = None if args.memory_budget_gib is None else int(args.memory_budget_gib * GiB)
    store = DiskStore(os.path.join(args.store, f"rank{rank}"), threads=args.io_threads, memory_budget=budget,
                      max_inflight_bytes=None if args.inflight_mib is None else args.inflight_mib << 20)
    directories, knobs = all_gather_objects(store.directory), agreed_knobs(config_of(args), store)
    if rank == 0:
        print("scratch stores (removed at exit): " + ", ".join(directories), flush=True)
        print(report.table(budget_rows(store, config_of(args), world, knobs)), flush=True)
        where = "partitioned() in memory" if args.in_memory else "partitioned(remote_device=store)"
        print(f"store: {store.mode}; building {args.params} under {where}; AdamW lr "
              f"{args.lr or lr_for(config_of(args)):.2e} ({max(args.warmup, 1)}-step warm-up), "
              f"{args.batch_size} x {args.seq_len} tokens per rank, system load "
              f"{os.getloadavg()[0]:.1f}", flush=True)
    start = time.perf_counter()
    model, optimizer, schedule = build(args, store, knobs)
    built = broadcast_object(time.perf_counter() - start, src=0)
    if rank == 0:
        print(f"built in {report.clock(built)}; RSS {snapshot().rss_bytes / 2**20:.0f} MiB on rank 0", flush=True)
    tokens, _ = load_splits(None)
    gen = torch.Generator().manual_seed(args.seed + rank)
    first_batch = devices.to(device, *batch(tokens, args.batch_size, args.seq_len,
                                            torch.Generator().manual_seed(args.seed + rank)))
    timer, losses = CommTimer(), []
    for step in range(1, args.steps + 1):
        before, comm0, t0 = store.stats.snapshot(), timer.seconds, time.perf_counter()
        gen = torch.Generator().manual_seed(args.seed + rank) if args.same_batch else gen
        losses.append(train_step(model, optimizer, schedule, tokens, gen, args))
        wall = time.perf_counter() - t0
        rss = all_gather_objects(snapshot().rss_bytes)
        if rank == 0:
            print(line(step, args.steps, losses[-1], wall, io_delta(store, before), timer.seconds - comm0, rss),
                  flush=True)
    again = batch_loss(model, *first_batch)  # each step's batch is new: 16 tokens are a noisy sample
    peaks = all_gather_objects(snapshot().peak_rss_bytes)
    usage = resource.getrusage(resource.RUSAGE_SELF)  # this rank, all its threads (IO included)
    cpu = all_gather_objects((usage.ru_utime, usage.ru_stime))
    if rank == 0:
        print(report.table([("model", f"{args.params} ({psi / 1e9:.2f} B params), world {world}"),
                            ("loss first -> last", f"{losses[0]:.4f} -> {losses[-1]:.4f}"),
                            ("step 1's batch: loss before -> after training", f"{losses[0]:.4f} -> {again:.4f}"),
                            ("peak RSS per rank", ", ".join(f"{p / GiB:.2f} GiB" for p in peaks)),
                            ("store per rank", f"{store.used_bytes / GiB:.1f} GiB ({store.mode})"),
                            ("CPU time per rank (user + sys)",
                             ", ".join(f"{u:.0f} + {k:.0f} s" for u, k in cpu)),
                            ("system load (1, 5, 15 min)", " ".join(f"{x:.1f}" for x in os.getloadavg())),
                            ("total time", report.clock(time.perf_counter() - start))]), flush=True)
    timer.remove()
    store.close()
    dist.barrier()  # no rank tears its connections down while another still works
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
