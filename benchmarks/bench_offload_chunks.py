"""OffloadedOptimizer's step: a chunk as large as the store's in-flight cap vs the default (half).

    python benchmarks/bench_offload_chunks.py [--store /tmp/parts-bench-chunks] [--rounds 4]

One process, one store, 58M fp32 parameters parked in it (one rank's share of the 125M
model of bench_offload.py) with their grads stored, AdamW state in the store. Two
``OffloadedOptimizer``s over two copies, chunk_bytes 256 MiB on a store whose cap is 256 MiB:
"cap" steps with chunks of the whole cap (the behaviour before ``step_chunk_bytes``, forced
here by replacing that property), "half" with the library's chunk (half the cap). Steps
alternate (cap, half, half, cap, ...); printed per system: step wall and CPU time (medians),
seconds the training thread waited on IO, and bytes moved over the wall time with IO in flight.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from record import record

from parts.offload import DiskStore, OffloadedOptimizer, parking

NUMEL, COUNT = 2_900_000, 20


def make(store: DiskStore, prefix: str) -> tuple[list[torch.Tensor], OffloadedOptimizer]:
    """``COUNT`` parked parameters and an AdamW over them with its state in ``store``."""
    params = [torch.randn(NUMEL) for _ in range(COUNT)]
    for i, p in enumerate(params):
        parking.park(p, store, f"{prefix}/p{i}")
    return params, OffloadedOptimizer(torch.optim.AdamW(params, lr=1e-4), store,
                                      chunk_bytes=256 << 20, prefix=prefix)


def step(store: DiskStore, params: list, opt: OffloadedOptimizer) -> tuple[float, float, object]:
    """Store a grad for every parameter, then one timed ``opt.step()``: (wall, CPU, store counters)."""
    for p in params:
        parking.accumulate_grad(p, torch.full((NUMEL,), 1e-3), accumulate=False)
    store.flush()
    before, wall, cpu = store.stats.snapshot(), time.perf_counter(), time.process_time()
    opt.step()
    out = (time.perf_counter() - wall, time.process_time() - cpu, store.stats.minus(before))
    opt.zero_grad()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="/tmp/parts-bench-chunks")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    store = DiskStore(args.store, max_inflight_bytes=256 << 20)
    systems = {"cap": make(store, "cap"), "half": make(store, "half")}
    systems["cap"][1].step_chunk_bytes = 256 << 20  # instance attribute: the old chunk
    load0 = os.getloadavg()
    for params, opt in systems.values():
        step(store, params, opt)  # creates the state
    results: dict[str, list] = {name: [] for name in systems}
    for r in range(args.rounds):
        for name in (("cap", "half") if r % 2 == 0 else ("half", "cap")):
            results[name].append(step(store, *systems[name]))
    print(f"{store.mode}; {COUNT} x {NUMEL} fp32 params, AdamW; system load at start "
          f"{' '.join(f'{x:.1f}' for x in load0)}, at end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| chunk | step wall (s) | step CPU (s) | IO wait per step (s) | GB/s over IO wall |")
    print("|---|---|---|---|---|")
    table = []
    for name, rows in results.items():
        chunk = systems[name][1].step_chunk_bytes >> 20
        rate = [(io.bytes_read + io.bytes_written) / io.busy_seconds / 1e9 for _, _, io in rows]
        print(f"| {chunk} MiB ({name}) | {statistics.median(w for w, _, _ in rows):.2f} "
              f"| {statistics.median(c for _, c, _ in rows):.2f} "
              f"| {statistics.median(io.wait_seconds for _, _, io in rows):.2f} "
              f"| {min(rate):.2f}-{max(rate):.2f} |")
        table.append({"chunk": f"{chunk} MiB ({name})",
                      "step_wall_s": round(statistics.median(w for w, _, _ in rows), 3),
                      "step_cpu_s": round(statistics.median(c for _, c, _ in rows), 3),
                      "io_wait_s": round(statistics.median(io.wait_seconds for _, _, io in rows), 3),
                      "GBps_over_io_wall": f"{min(rate):.2f}-{max(rate):.2f}"})
    record("bench_offload_chunks", {"rows": table, "summary": {"store": store.mode}})
    store.close()


if __name__ == "__main__":
    main()
