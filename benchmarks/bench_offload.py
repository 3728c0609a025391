"""Benchmark parts.offload: the disk's raw bandwidth, then in-memory vs offloaded ZeRO-3 training.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_offload.py
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_offload.py --params 25M --raw-gib 1
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_offload.py --device cuda  # GPU compute, NCCL

1. Raw sequential write and read bandwidth of the store's file system, measured with the
   store's own IO path (``DiskStore.write``/``read`` of one ``--raw-gib`` tensor): rank 0
   alone, then both ranks at once (training shares the disk the same way); again after
   training (the machine is shared: the two brackets show how much the disk moved). "Raw"
   per rank below = the disk's best total of these runs, shared by the ranks: a rank whose
   IO does not coincide with the other's can get more than its share, so a figure above
   100% is possible and means the raw runs were slowed (by someone else's IO) or the ranks' IO
   did not overlap. Then rank 0 reads into fresh and into touched memory (page-fault cost).
2. The same GPT trained in memory (``partitioned()`` + ``AdamW(shards)``) and offloaded
   (``partitioned(remote_device=store)`` + ``OffloadedOptimizer``), same knobs, both built
   up front and stepped in alternating order (mem, off, off, mem, ...) so load swings hit
   both. Per offloaded step: bytes read and written per rank, and bytes copied through
   bounce buffers (unaligned memory); achieved read (write) bandwidth = bytes over the wall
   time with an IO thread moving bytes of that kind (``StoreStats.read_active_seconds``:
   inside pread/pwrite or a bounce copy; not the time a request sat in the store's queue,
   held behind its key's previous operation, or the training step computed); where reads and
   writes overlap both kinds count that time, so each kind alone under-states the device's
   use, and "both" = (reads at raw read speed + writes at raw write speed) / wall time with
   any transfer moving: 100% means the store moved bytes as fast as the raw sequential runs;
   also, as before, bytes over the wall time with any read (write) *in flight* (queued
   included). The share of IO hidden behind compute and communication = 1 - (time the
   training thread waited on IO) / (wall time with any IO in flight); the offloaded /
   in-memory ratio of wall and of CPU time per step (medians); compute per step (the
   in-memory step) against IO per step at the raw bandwidth, which decides where the 50%
   and 1.3x targets apply.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import devices  # noqa: E402
from chardata import VOCAB_SIZE, batch, load_splits  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402
from record import record  # noqa: E402
from train_offload import PRESETS, count_params  # noqa: E402

from parts.comm import all_gather_objects  # noqa: E402
from parts.observe import set_mmap_threshold  # noqa: E402
from parts.offload import DiskStore, OffloadedOptimizer, StoreStats  # noqa: E402
from parts.offload.parking import empty_for_io  # noqa: E402
from parts.partition import attach, detach, partitioned, shards  # noqa: E402

GiB = 2**30
_DEVICE = [torch.device("cpu")]  # this rank's compute device, set from --device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``args.device`` comes back resolved to ``cpu`` or ``cuda``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", choices=sorted(PRESETS), default="125M")
    ap.add_argument("--store", default="/tmp/parts-bench-offload")
    ap.add_argument("--raw-gib", type=float, default=1.0, help="size of the raw-bandwidth file per rank")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="measured steps per system (after 2 warm-up steps)")
    ap.add_argument("--reuse-bytes", type=int, default=64 << 20,
                    help="the store's reuse_bytes (memory of dropped shards kept for their next loads; 0: none)")
    ap.add_argument("--after-backward", action="store_true",
                    help="step the offloaded optimizer after backward, not during it (step_in_backward)")
    ap.add_argument("--within-step", action="store_true",
                    help="offloaded optimizer's pipeline within each step only (across_steps=False)")
    return devices.parse_with_device(ap, argv)


def raw_bandwidth(store: DiskStore, nbytes: int, active: bool) -> tuple[float, float]:
    """(write, read) GB/s of one ``nbytes`` tensor through ``store`` (0, 0 when not ``active``), in
    aligned memory as the store's own buffers are (direct IO in place, no bounce copy)."""
    data = empty_for_io((nbytes,), torch.uint8).fill_(7)
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
    with partitioned(device=_DEVICE[0], remote_device=store):
        model = GPT(config)
    layer = 12 * width ** 2
    attach(model, prefetch_bucket_size=layer, max_live_parameters=2 * layer, max_reuse_distance=0,
           persistence_threshold=4 * width, reduce_bucket_size=layer)
    inner = torch.optim.AdamW(shards(model), lr=1e-4)
    if store is None:
        return model, inner
    return model, OffloadedOptimizer(inner, store, chunk_bytes=256 << 20, across_steps=not args.within_step)


def step(model, opt, tokens, gen, args, store, flush: bool = True) -> dict:
    """One training step: wall and CPU seconds (this process, IO threads included), store counters.
    ``flush``: the next step is the other system's, so the writes this step leaves behind and
    the reads it starts ahead are waited inside its own time (they stay for its next step, as in
    training: nothing else touches the store); else they overlap the next step, which also
    counts their bytes."""
    before = store.stats.snapshot() if store is not None else None
    wall, cpu = time.perf_counter(), time.process_time()
    loss = model(*devices.to(_DEVICE[0], *batch(tokens, args.batch_size, args.seq_len, gen)))
    with opt.step_in_backward() if store is not None and not args.after_backward else contextlib.nullcontext():
        loss.backward()
    mid, opt_wall = store.stats.snapshot() if store is not None else None, time.perf_counter()
    opt.step()
    opt.zero_grad()
    if store is not None and flush:
        store.flush()
    devices.sync(_DEVICE[0])
    opt_wall = time.perf_counter() - opt_wall
    dist.barrier()
    out = dict(wall=time.perf_counter() - wall, cpu=time.process_time() - cpu, opt_wall=opt_wall)
    if store is not None:
        out["io"], out["opt_io"] = store.stats.minus(before), store.stats.minus(mid)
    return out


def measure(args, tokens, store) -> tuple[list[dict], list[dict]]:
    """Per-step records of the in-memory and the offloaded system, stepped alternately (mem, off,
    off, mem, ...: an offloaded step followed by another one leaves its writes behind to it)."""
    systems = [build(args, None), build(args, store)]
    gens = [torch.Generator().manual_seed(dist.get_rank()) for _ in systems]
    for _ in range(2):  # warm-up: records the traces (the coordinator's, the landing order), creates state
        for (model, opt), gen, st in zip(systems, gens, (None, store)):
            step(model, opt, tokens, gen, args, st)
    order = [w for r in range(args.rounds) for w in ((0, 1) if r % 2 == 0 else (1, 0))]
    records: list[list[dict]] = [[], []]
    for i, which in enumerate(order):
        model, opt = systems[which]
        flush = i + 1 == len(order) or order[i + 1] != which
        records[which].append(step(model, opt, tokens, gens[which], args, store if which else None, flush))
    for model, _ in systems:
        detach(model)
    return records[0], records[1]


def fresh_read(store: DiskStore, nbytes: int, active: bool) -> tuple[tuple[float, float], ...]:
    """(GB/s, CPU s per GiB) of a read of ``nbytes`` into fresh memory, then into the same memory
    again (touched): what a page fault per 4 KiB costs a read; () when not ``active``."""
    out = []
    if active:
        store.write("raw", empty_for_io((nbytes,), torch.uint8).fill_(7)).wait()
        data = empty_for_io((nbytes,), torch.uint8)
        for _ in range(2):
            wall, cpu = time.perf_counter(), time.process_time()
            store.read("raw", data).wait()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            out.append((nbytes / wall / 1e9, cpu / (nbytes / GiB)))
        store.delete("raw")
    dist.barrier()
    return tuple(out)


def raw_pair(store, nbytes: int, rank: int) -> tuple[tuple[float, float], list]:
    """(rank 0 alone, every rank's at once) raw (write, read) GB/s."""
    return raw_bandwidth(store, nbytes, rank == 0), all_gather_objects(raw_bandwidth(store, nbytes, True))


def setup(device: str) -> tuple[int, int]:
    """Join the group (gloo, or NCCL on LOCAL_RANK's GPU); a share of the cores per rank; large
    buffers mapped (freed at once)."""
    _DEVICE[0] = devices.init(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    set_mmap_threshold(128 * 1024)
    return rank, world


def main() -> None:
    args = parse_args()
    rank, world = setup(args.device)
    store = DiskStore(os.path.join(args.store, f"rank{rank}"), reuse_bytes=args.reuse_bytes)
    nbytes = int(args.raw_gib * GiB)
    load0, cpu0, wall0 = os.getloadavg(), time.process_time(), time.perf_counter()
    raw_before = raw_pair(store, nbytes, rank)
    fresh = fresh_read(store, nbytes, rank == 0)
    tokens, _ = load_splits(None)
    memory, offload = measure(args, tokens, store)
    raw_after = raw_pair(store, nbytes, rank)
    rows = all_gather_objects((memory, offload, time.process_time() - cpu0))
    if rank == 0:
        report(args, store, (raw_before, raw_after), rows, world, (load0, os.getloadavg()),
               time.perf_counter() - wall0)
        (f_bw, f_cpu), (t_bw, t_cpu) = fresh
        print(f"rank 0 alone, a read into fresh memory: {f_bw:.2f} GB/s, {f_cpu:.2f} s CPU per GiB "
              f"(page faults); into the same memory again: {t_bw:.2f} GB/s, {t_cpu:.2f} s CPU per GiB")
    store.close()
    dist.destroy_process_group()


def _median(records: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in records)


def _io_sum(records: list[dict], key: str = "io") -> StoreStats:
    total = StoreStats()
    for r in records:
        total = StoreStats(**{k: getattr(total, k) + getattr(r[key], k) for k in total.__dict__})
    return total


def report(args, store, raws, rows, world, loads, wall) -> None:
    """Print the raw bandwidth, the per-rank table and the achieved share of the disk's raw bandwidth."""
    layers, width, heads = PRESETS[args.params]
    psi = count_params(GPTConfig(vocab_size=VOCAB_SIZE, block_size=args.seq_len, n_layer=layers,
                                 n_head=heads, n_embd=width))
    print(f"store: {store.mode}, {store.threads} IO threads, {store.block_bytes >> 20} MiB blocks, "
          f"{store.max_inflight_bytes >> 20} MiB in flight, {store.reuse.capacity >> 20} MiB reuse")
    for when, (solo, both) in zip(("before", "after"), raws):
        print(f"raw sequential {when} training, {args.raw_gib:g} GiB file: rank 0 alone write {solo[0]:.2f} "
              f"read {solo[1]:.2f} GB/s; {world} ranks at once, per rank: write "
              + " ".join(f"{w:.2f}" for w, _ in both) + ", read " + " ".join(f"{r:.2f}" for _, r in both))
    raw_w, raw_r = (_best_disk(raws, kind) / world for kind in (0, 1))
    print(f"model {args.params} ({psi / 1e6:.0f} M params), world {world}, {args.batch_size}x{args.seq_len} "
          f"tokens per rank, medians of {args.rounds} alternating steps per system")
    print("| rank | in-memory step wall / CPU (s) | offloaded step wall / CPU (s) | ratio wall / CPU "
          "| read / write / copied per step | achieved read GB/s (% raw) | achieved write GB/s (% raw) "
          "| achieved both (% raw) | read / write over in-flight time (% raw) "
          "| IO at raw / step (s) | IO busy / wait per step (s) | IO hidden |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    table = [_row(rank, memory, offload, raw_r, raw_w, args.rounds) for rank, (memory, offload, _) in enumerate(rows)]
    print("optimizer step alone (the IO-bound phase: every shard, grad and state streamed once):")
    print("| rank | in-memory (s) | offloaded (s) | read | write | achieved read GB/s (% raw) "
          "| achieved write GB/s (% raw) | achieved both (% raw) | reads + writes over moving time (GB/s) "
          "| waited on IO (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rank, (memory, offload, _) in enumerate(rows):
        _opt_row(rank, memory, offload, raw_r, raw_w, args.rounds)
    print(f"raw per rank (the disk's best total of the runs above, rank 0 alone or {world} ranks at once, "
          f"shared by {world}): write {raw_w:.2f}, read {raw_r:.2f} GB/s")
    cpu = ", ".join(f"{c:.0f} s" for _, _, c in rows)
    print(f"CPU time per rank (whole run, user + sys, IO threads included): {cpu}; wall {wall:.0f} s; "
          f"system load (1, 5, 15 min) at start {_load(loads[0])}, at end {_load(loads[1])}")
    record("bench_offload" + ("_cuda" if args.device == "cuda" else ""), {"rows": table, "summary": {
        "model": f"{args.params} ({psi / 1e6:.0f} M params), world {world}",
        "store": store.mode, "raw per rank write / read (GB/s)": f"{raw_w:.2f} / {raw_r:.2f}",
        "optimizer": "stepping after backward" if args.after_backward else "stepping during backward",
        "compute": args.device}})


def _best_disk(raws, kind: int) -> float:
    """The disk's highest total GB/s of one kind (0 write, 1 read) seen in the raw runs: rank 0
    alone or the ranks' sum at once, before or after training (the machine is shared: the
    physical limit is the best it showed, not a run slowed by someone else's IO)."""
    return max(max(solo[kind], sum(pair[kind] for pair in both)) for solo, both in raws)


def _load(avg) -> str:
    return " ".join(f"{x:.1f}" for x in avg)


def _achieved(io: StoreStats, raw_r: float, raw_w: float) -> tuple[str, str, str]:
    """Read, write and both-kinds achieved bandwidth over the time bytes were moving, vs raw."""
    read_bw = io.bytes_read / max(io.read_active_seconds, 1e-9) / 1e9
    write_bw = io.bytes_written / max(io.write_active_seconds, 1e-9) / 1e9
    at_raw = (io.bytes_read / raw_r + io.bytes_written / raw_w) / 1e9
    return (f"{read_bw:.2f} ({read_bw / raw_r:.0%})", f"{write_bw:.2f} ({write_bw / raw_w:.0%})",
            f"{at_raw / max(io.active_seconds, 1e-9):.0%}")


def _opt_row(rank, memory, offload, raw_r, raw_w, n) -> None:
    io = _io_sum(offload, "opt_io")
    both = (io.bytes_read + io.bytes_written) / max(io.active_seconds, 1e-9) / 1e9
    print(f"| {rank} | {_median(memory, 'opt_wall'):.2f} | {_median(offload, 'opt_wall'):.2f} "
          f"| {io.bytes_read / n / GiB:.2f} GiB | {io.bytes_written / n / GiB:.2f} GiB "
          f"| {' | '.join(_achieved(io, raw_r, raw_w))} | {both:.2f} | {io.wait_seconds / n:.2f} |")


def _row(rank, memory, offload, raw_r, raw_w, n) -> dict:
    io = _io_sum(offload)
    m_wall, m_cpu = _median(memory, "wall"), _median(memory, "cpu")
    o_wall, o_cpu = _median(offload, "wall"), _median(offload, "cpu")
    queued_r = io.bytes_read / max(io.read_busy_seconds, 1e-9) / 1e9 / raw_r
    queued_w = io.bytes_written / max(io.write_busy_seconds, 1e-9) / 1e9 / raw_w
    at_raw = (io.bytes_read / raw_r + io.bytes_written / raw_w) / 1e9 / n
    hidden = 1 - io.wait_seconds / io.busy_seconds if io.busy_seconds else 0.0
    print(f"| {rank} | {m_wall:.2f} / {m_cpu:.2f} | {o_wall:.2f} / {o_cpu:.2f} | {o_wall / m_wall:.2f} / "
          f"{o_cpu / m_cpu:.2f} | {io.bytes_read / n / GiB:.2f} / {io.bytes_written / n / GiB:.2f} / "
          f"{io.bytes_bounced / n / GiB:.2f} GiB | {' | '.join(_achieved(io, raw_r, raw_w))} "
          f"| {queued_r:.0%} / {queued_w:.0%} "
          f"| {at_raw:.2f} | {io.busy_seconds / n:.2f} / {io.wait_seconds / n:.2f} | {hidden:.0%} |")
    read, write, both = _achieved(io, raw_r, raw_w)
    return {"rank": rank, "in_memory_step_s": round(m_wall, 3), "offloaded_step_s": round(o_wall, 3),
            "ratio_wall": round(o_wall / m_wall, 3), "ratio_cpu": round(o_cpu / m_cpu, 3),
            "read_GiB_per_step": round(io.bytes_read / n / GiB, 3),
            "write_GiB_per_step": round(io.bytes_written / n / GiB, 3),
            "achieved_read_GBps": read, "achieved_write_GBps": write, "achieved_both": both,
            "io_hidden": f"{hidden:.0%}"}


if __name__ == "__main__":
    main()
