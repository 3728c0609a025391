"""Benchmark parts.offload: the disk's raw bandwidth, then in-memory vs offloaded ZeRO-3 training.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_offload.py
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_offload.py --params 25M --raw-gib 1

1. Raw sequential write and read bandwidth of the store's file system, measured with the
   store's own IO path (``DiskStore.write``/``read`` of one ``--raw-gib`` tensor): first rank
   0 alone, then both ranks at once (training shares the disk the same way).
2. The same GPT trained in memory (``partitioned()`` + ``AdamW(shards)``) and offloaded
   (``partitioned(remote_device=store)`` + ``OffloadedOptimizer``), same knobs, alternating
   rounds; per offloaded step: bytes read and written per rank, achieved bandwidth (bytes
   over the wall time with IO in flight), the share of IO time hidden behind compute and
   communication (1 - time the training thread waited on IO / IO busy time), and the
   offloaded / in-memory step ratio (medians).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
from chardata import VOCAB_SIZE, batch, load_splits  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402
from train_offload import PRESETS, count_params  # noqa: E402

from parts.comm import all_gather_objects  # noqa: E402
from parts.observe import set_mmap_threshold  # noqa: E402
from parts.offload import DiskStore, OffloadedOptimizer  # noqa: E402
from parts.partition import attach, detach, partitioned, shards  # noqa: E402

GiB = 2**30


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", choices=sorted(PRESETS), default="125M")
    ap.add_argument("--store", default="/tmp/parts-bench-offload")
    ap.add_argument("--raw-gib", type=float, default=1.0, help="size of the raw-bandwidth file per rank")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="measured steps per system (after 1 warm-up)")
    return ap.parse_args()


def raw_bandwidth(store: DiskStore, nbytes: int, active: bool) -> tuple[float, float]:
    """(write, read) GB/s of one ``nbytes`` tensor through ``store`` (0, 0 when not ``active``)."""
    data = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
    dist.barrier()
    start = time.perf_counter()
    if active:
        store.write("raw", data).wait()
    dist.barrier()
    wrote = time.perf_counter() - start
    start = time.perf_counter()
    if active:
        store.read("raw", data).wait()
    dist.barrier()
    read = time.perf_counter() - start
    if active:
        store.delete("raw")
    return (nbytes / wrote / 1e9, nbytes / read / 1e9) if active else (0.0, 0.0)


def build(args, store):
    layers, width, heads = PRESETS[args.params]
    config = GPTConfig(vocab_size=VOCAB_SIZE, block_size=args.seq_len, n_layer=layers, n_head=heads, n_embd=width)
    torch.manual_seed(0)
    with partitioned(remote_device=store):
        model = GPT(config)
    layer = 12 * width ** 2
    attach(model, prefetch_bucket_size=layer, max_live_parameters=2 * layer, max_reuse_distance=0,
           persistence_threshold=4 * width, reduce_bucket_size=layer)
    inner = torch.optim.AdamW(shards(model), lr=1e-4)
    return model, (OffloadedOptimizer(inner, store, chunk_bytes=256 << 20) if store is not None else inner)


def step(model, opt, tokens, gen, args) -> float:
    start = time.perf_counter()
    model(*batch(tokens, args.batch_size, args.seq_len, gen)).backward()
    opt.step()
    opt.zero_grad()
    dist.barrier()
    return time.perf_counter() - start


def measure(args, tokens, store):
    """Median step time and, offloaded, per-step store counters (summed over measured steps)."""
    model, opt = build(args, store)
    gen = torch.Generator().manual_seed(dist.get_rank())
    step(model, opt, tokens, gen, args)  # warm-up: records the trace, creates optimizer state
    before = store.stats.snapshot() if store is not None else None
    times = [step(model, opt, tokens, gen, args) for _ in range(args.rounds)]
    detach(model)
    return statistics.median(times), (store.stats.minus(before) if store is not None else None)


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    set_mmap_threshold(128 * 1024)
    store = DiskStore(os.path.join(args.store, f"rank{rank}"))
    nbytes = int(args.raw_gib * GiB)
    solo = raw_bandwidth(store, nbytes, rank == 0)
    both = all_gather_objects(raw_bandwidth(store, nbytes, True))
    tokens, _ = load_splits(None)
    memory_step, _ = measure(args, tokens, None)
    offload_step, io = measure(args, tokens, store)
    rows = all_gather_objects((offload_step, io))
    if rank == 0:
        report(args, store, solo, both, memory_step, rows, world)
    store.close()
    dist.destroy_process_group()


def report(args, store, solo, both, memory_step, rows, world) -> None:
    psi = count_params(GPTConfig(vocab_size=VOCAB_SIZE, block_size=args.seq_len, n_layer=PRESETS[args.params][0],
                                 n_head=PRESETS[args.params][2], n_embd=PRESETS[args.params][1]))
    raw_w, raw_r = sum(w for w, _ in both), sum(r for _, r in both)
    print(f"store: {store.mode}, {store.threads} IO threads, {store.block_bytes >> 20} MiB blocks")
    print(f"raw sequential, {args.raw_gib:g} GiB file: rank 0 alone write {solo[0]:.2f} GB/s read {solo[1]:.2f} GB/s; "
          f"{world} ranks at once (sum) write {raw_w:.2f} GB/s read {raw_r:.2f} GB/s")
    print(f"model {args.params} ({psi / 1e6:.0f} M params), world {world}, {args.batch_size}x{args.seq_len} "
          f"tokens per rank, median of {args.rounds} steps")
    print("| rank | in-memory step (s) | offloaded step (s) | ratio | read / step | write / step "
          "| achieved read GB/s | achieved write GB/s | IO busy (s) | IO wait (s) | IO hidden |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for rank, (offload_step, io) in enumerate(rows):
        n = args.rounds
        busy_r = io.read_seconds / store.threads
        busy_w = io.write_seconds / store.threads
        hidden = 1 - io.wait_seconds / io.busy_seconds if io.busy_seconds else 0.0
        print(f"| {rank} | {memory_step:.2f} | {offload_step:.2f} | {offload_step / memory_step:.2f} "
              f"| {io.bytes_read / n / GiB:.2f} GiB | {io.bytes_written / n / GiB:.2f} GiB "
              f"| {io.bytes_read / max(busy_r, 1e-9) / 1e9:.2f} | {io.bytes_written / max(busy_w, 1e-9) / 1e9:.2f} "
              f"| {io.busy_seconds / n:.2f} | {io.wait_seconds / n:.2f} | {hidden:.0%} |")
        total = (io.bytes_read + io.bytes_written) / max(io.busy_seconds, 1e-9) / 1e9
        print(f"  rank {rank}: reads + writes over the wall time with any IO in flight: {total:.2f} GB/s")
    print(f"achieved read/write GB/s per rank: bytes over (transfer seconds summed over IO threads / "
          f"threads); compare with the {world}-rank raw sum / {world}: write {raw_w / world:.2f}, "
          f"read {raw_r / world:.2f} GB/s")


if __name__ == "__main__":
    main()
