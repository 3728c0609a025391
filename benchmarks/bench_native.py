"""Benchmark parts.csrc: native (C++) vs pure-torch time for flatten/unflatten/copy_in/copy_out.

Prints one row per (op, total size, tensor count) with both median times and the ratio
native/torch (< 1 means native is faster). Example: python benchmarks/bench_native.py --large
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from record import record

from parts.csrc import native, reference

MB = 1 << 20


def _sizes(total_bytes: int, count: int, itemsize: int, gen: torch.Generator) -> list[int]:
    """Uneven element counts (weights 0.5..1.5) summing to about total_bytes."""
    w = torch.rand(count, generator=gen, dtype=torch.float64) + 0.5
    return [max(1, int(x)) for x in (w / w.sum() * (total_bytes // itemsize)).tolist()]


def _cases(total_bytes: int, count: int, world: int, dtype: torch.dtype) -> dict[str, tuple]:
    """Arguments for each op: tensors of uneven sizes sharded over `world` ranks."""
    gen = torch.Generator().manual_seed(count)
    numels = _sizes(total_bytes, count, torch.tensor([], dtype=dtype).element_size(), gen)
    ts = [torch.randn(n, generator=gen).to(dtype) for n in numels]
    shard = [-(-n // world) for n in numels]
    offsets = [sum(shard[:i]) for i in range(len(shard))]
    chunk = sum(shard)
    flat = torch.cat(ts)
    shards = [t[:s] for t, s in zip(ts, shard)]  # rank 0's shards (full-length)
    gathered = torch.randn(world * chunk, generator=gen).to(dtype)
    return {
        "flatten": (ts,),
        "unflatten": (flat, ts),
        "copy_in": (shards, torch.empty(chunk, dtype=dtype), offsets),
        "copy_out": (gathered, [torch.empty_like(t) for t in ts], world, offsets, shard),
    }


def _time_pair(f_ref, f_nat, args: tuple, budget: float, min_reps: int = 5) -> tuple:
    """(median, min) seconds per call for torch and native, alternating calls so noise hits both."""
    f_ref(*args), f_nat(*args)
    ref: list[float] = []
    nat: list[float] = []
    start = time.perf_counter()
    while len(ref) < min_reps or (time.perf_counter() - start < budget and len(ref) < 200):
        for fn, out in ((f_ref, ref), (f_nat, nat)):
            t0 = time.perf_counter()
            fn(*args)
            out.append(time.perf_counter() - t0)
    return (statistics.median(ref), min(ref)), (statistics.median(nat), min(nat))


def _pretouch(mb: int) -> None:
    """Touch `mb` MB once so a fresh VM's lazily backed pages do not bias the first cases."""
    if mb > 0:
        torch.ones(mb * MB // 4)


def main() -> None:
    """Parse arguments, run every case and print the table."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--large", action="store_true", help="also run 1024 MB (about 4 GB of RAM)")
    p.add_argument("--counts", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--budget", type=float, default=0.3, help="seconds per timing")
    p.add_argument("--pretouch-mb", type=int, default=2048)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    sizes = a.sizes_mb + ([1024] if a.large and 1024 not in a.sizes_mb else [])
    _pretouch(a.pretouch_mb)
    t0 = time.perf_counter()
    native.flatten([torch.zeros(1)])  # build/load outside the timings
    print(f"native ready in {time.perf_counter() - t0:.1f} s; threads={a.threads}, "
          f"world_size={a.world_size}, dtype={a.dtype}")
    print(f"{'op':<10}{'MB':>6}{'tensors':>9}{'torch ms':>11}{'native ms':>11}{'ratio':>8}{'min ratio':>10}")
    dtype = getattr(torch, a.dtype)
    ratios: dict[str, list[float]] = {}
    rows: list[dict] = []
    for mb in sizes:
        for count in a.counts:
            cases = _cases(mb * MB, count, a.world_size, dtype)
            for op, args in cases.items():
                (tr, mr), (tn, mn) = _time_pair(getattr(reference, op), getattr(native, op),
                                                args, a.budget)
                print(f"{op:<10}{mb:>6}{count:>9}{tr * 1e3:>11.3f}{tn * 1e3:>11.3f}"
                      f"{tn / tr:>8.2f}{mn / mr:>10.2f}", flush=True)
                ratios.setdefault(op, []).append(mn / mr)
                rows.append({"op": op, "MB": mb, "tensors": count, "torch_ms": round(tr * 1e3, 3),
                             "native_ms": round(tn * 1e3, 3), "min_ratio": round(mn / mr, 3)})
            del cases
    print("geometric mean of min ratios (native/torch): " + ", ".join(
        f"{op}={statistics.geometric_mean(r):.2f}" for op, r in ratios.items()))
    summary = {f"{op}: geometric mean of native/torch": round(statistics.geometric_mean(r), 3)
               for op, r in ratios.items()}
    record("bench_native", {"rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
