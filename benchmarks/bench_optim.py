"""Benchmark the BF16Optimizer step alone, and its model-state bytes per rank.

    python benchmarks/bench_optim.py [--numel 4000000] [--steps 10]
    python benchmarks/bench_optim.py --device cuda     # one GPU per rank, NCCL; records bench_optim_cuda

Times ``step()`` (reduce-scatter, global norm, clip, inner AdamW step on the fp32
partition, copy-back to bf16, bucketed all-gather) of BF16Optimizer at world 2
(two gloo processes spawned here, one thread each) and at world 1, against
``torch.optim.AdamW`` stepping full fp32 params in one process (plus
``clip_grad_norm_``, the same work minus communication). No forward/backward is
timed: grads are written straight into the fp32 grad buffers (bf16 matmuls on
this CPU would drown the optimizer). Memory is storage accounting, per rank:
bf16 flat buffer, fp32 master partition, optimizer state, fp32 grad buffer, against
(4 + K) * Psi / N + 2 * Psi with K = 8 for AdamW.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from record import record

from parts.optim import BF16Optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import devices  # noqa: E402

K_ADAMW = 8
_DEVICE = [torch.device("cpu")]  # this process's device, set from --device


def shapes(numel: int) -> list[tuple[int, ...]]:
    """GPT-like parameter shapes (matrices, biases, norms) totalling about ``numel``."""
    d = max(8, int((numel / 12) ** 0.5))  # one block: 12 d^2 + 13 d elements
    return [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,)]


def make_params(numel: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """Seeded parameters of the benchmark shapes."""
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s).to(dtype).to(_DEVICE[0])) for s in shapes(numel)]


def timed(fn, steps: int) -> float:
    """Fastest of ``steps`` calls after two warm-ups (the machine is shared: min resists noise)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(steps):
        if dist.is_initialized():
            dist.barrier()
        devices.sync(_DEVICE[0])
        t = time.perf_counter()
        fn()
        devices.sync(_DEVICE[0])
        times.append(time.perf_counter() - t)
    return min(times)


def _clocked(fn, sink: list):
    """``fn`` that appends its wall time to ``sink``."""
    def wrapper(*args, **kwargs):
        devices.sync(_DEVICE[0])
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        devices.sync(_DEVICE[0])
        sink.append(time.perf_counter() - t)
        return out
    return wrapper


def bench_wrapped(numel: int, steps: int) -> dict:
    """BF16Optimizer step time and storage bytes on this rank."""
    params = make_params(numel, torch.bfloat16)
    opt = BF16Optimizer(torch.optim.AdamW(params, lr=1e-4), clip_grad=1.0,
                        allgather_bucket_size=50_000_000)
    gen = torch.Generator().manual_seed(1 + (dist.get_rank() if dist.is_initialized() else 0))
    grads = [torch.randn(fg.grad.numel(), generator=gen).to(_DEVICE[0]) for fg in opt.flat_groups]

    parts = {"reduce-scatter": [], "inner step": [], "copy-back + all-gather": []}
    for key, owner, attr in (("reduce-scatter", opt, "_reduce_grads"),
                             ("inner step", opt.optimizer, "step"),
                             ("copy-back + all-gather", opt, "write_back")):
        setattr(owner, attr, _clocked(getattr(owner, attr), parts[key]))

    def step() -> None:
        for fg, g in zip(opt.flat_groups, grads):
            fg.grad.copy_(g)  # what the post-accumulate-grad hooks leave after backward
        opt._has_grads = True
        opt.step()

    seconds = timed(step, steps)
    breakdown = {k: min(v[2:]) for k, v in parts.items()}
    fg = opt.flat_groups[0]
    state = sum(v.untyped_storage().nbytes() for c in fg.master_chunks
                for v in opt.state[c].values() if torch.is_tensor(v) and v.dim() > 0)
    return {"seconds": seconds, "breakdown": breakdown, "psi": sum(p.numel() for p in params),
            "bf16": fg.flat.untyped_storage().nbytes(), "master": fg.master.untyped_storage().nbytes(),
            "state": state, "grad": fg.grad.untyped_storage().nbytes()
            + (fg.part_grad.untyped_storage().nbytes() if fg.part_grad is not fg.grad else 0)}


def bench_plain(numel: int, steps: int, clip: bool) -> float:
    """torch AdamW on full fp32 params in one process (optionally with clip_grad_norm_)."""
    params = make_params(numel, torch.float32)
    opt = torch.optim.AdamW(params, lr=1e-4)
    for p in params:
        p.grad = torch.randn_like(p)

    def step() -> None:
        if clip:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    return timed(step, steps)


def _cheap_backward_then_step(params, backward, step, steps: int) -> tuple[float, float]:
    """Fastest (backward, step) seconds with an elementwise loss: sum(p * w) over params."""
    ws = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).to(p.dtype).to(p.device)
          for i, p in enumerate(params)]
    tb, ts = [], []
    for i in range(steps + 2):
        dist.barrier()
        devices.sync(_DEVICE[0])
        t0 = time.perf_counter()
        backward(sum((p * w).sum() for p, w in zip(params, ws)).float())
        devices.sync(_DEVICE[0])
        t1 = time.perf_counter()
        step()
        devices.sync(_DEVICE[0])
        t2 = time.perf_counter()
        if i >= 2:
            tb.append(t1 - t0)
            ts.append(t2 - t1)
    return min(tb), min(ts)


def bench_backward_step(system: str, numel: int, steps: int) -> tuple[float, float]:
    """parts vs DeepSpeed ZeRO-1 bf16 (fp32 reduction, clip 1.0): backward epilogue + step."""
    if system == "parts":
        params = make_params(numel, torch.bfloat16)
        opt = BF16Optimizer(torch.optim.AdamW(params, lr=1e-4), clip_grad=1.0,
                            allgather_bucket_size=50_000_000)

        def step() -> None:
            opt.step()
            opt.zero_grad()
        return _cheap_backward_then_step(params, lambda loss: loss.backward(), step, steps)
    import deepspeed
    model = torch.nn.Module()
    model.ps = torch.nn.ParameterList(make_params(numel, torch.float32))
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
           "communication_data_type": "fp32",
           "zero_optimization": {"stage": 1, "allgather_bucket_size": 50_000_000,
                                 "reduce_bucket_size": 50_000_000}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, dist_init_required=False,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
    return _cheap_backward_then_step(list(engine.module.ps), engine.backward, engine.step, steps)


def _worker(rank: int, world: int, port: int, numel: int, steps: int, queue,
            system: str = "step", device: str = "cpu") -> None:
    torch.set_num_threads(1)
    _DEVICE[0] = devices.init_spawned(device, rank, world, port)  # gloo, or NCCL on GPU ``rank``
    result = (bench_wrapped(numel, steps) if system == "step"
              else bench_backward_step(system, numel, steps))
    queue.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, numel: int, steps: int, system: str = "step", device: str = "cpu") -> list:
    """Spawn ``world`` ranks (gloo; NCCL for ``device="cuda"``) running ``bench_wrapped`` or a backward+step."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29000 + (os.getpid() + len(system)) % 1000
    procs = [ctx.Process(target=_worker, args=(r, world, port, numel, steps, queue, system, device))
             for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``args.device`` comes back resolved to ``cpu`` or ``cuda``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=4_000_000)
    ap.add_argument("--steps", type=int, default=10)
    return devices.parse_with_device(ap, argv)


def main() -> None:
    """Run and print the comparison."""
    args = parse_args()
    if args.device == "cuda":
        os.environ.setdefault("DS_ACCELERATOR", "cuda")  # DeepSpeed's, for its system
    torch.set_num_threads(1)
    _DEVICE[0] = devices.pick(args.device)
    plain = bench_plain(args.numel, args.steps, clip=False)
    plain_clip = bench_plain(args.numel, args.steps, clip=True)
    w1 = run_world(1, args.numel, args.steps, device=args.device)[0]
    w2 = run_world(2, args.numel, args.steps, device=args.device)
    psi = w1["psi"]
    print(f"Psi = {psi:,} params; fastest of {args.steps} steps; 1 thread per process")
    print(f"torch AdamW fp32, 1 process:                {plain * 1e3:8.1f} ms  (1.00)")
    print(f"torch clip_grad_norm_ + AdamW fp32, 1 proc: {plain_clip * 1e3:8.1f} ms  "
          f"({plain_clip / plain:.2f})")
    for name, res in (("BF16Optimizer world 1", w1), ("BF16Optimizer world 2", w2[0])):
        secs = max(r["seconds"] for r in (w2 if res is w2[0] else [res]))
        print(f"{name} (slowest rank):       {secs * 1e3:8.1f} ms  ({secs / plain:.2f})   "
              + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in res["breakdown"].items()))
    for n, res in ((1, w1), (2, w2[0])):
        expect = (4 + K_ADAMW) * psi / n + 2 * psi
        got = res["bf16"] + res["master"] + res["state"]
        print(f"world {n}: model-state bytes/rank = bf16 {res['bf16']:,} + master {res['master']:,} "
              f"+ state {res['state']:,} = {got:,} vs (4+K)Psi/N + 2Psi = {expect:,.0f} "
              f"({got / expect:.4f}); fp32 grad buffers {res['grad']:,}")
    print("world 2, elementwise backward (grad reduction happens here for DeepSpeed) + step:")
    systems = ["parts"]
    if importlib.util.find_spec("deepspeed") is not None:
        systems.append("deepspeed")
    else:
        print("  (deepspeed not importable: pip install --target DIR deepspeed; PYTHONPATH=DIR)")
    totals: dict[str, float] = {}
    rows = [{"system": "torch AdamW fp32, 1 process", "step_ms": round(plain * 1e3, 2), "vs_torch": 1.0},
            {"system": "torch clip_grad_norm_ + AdamW fp32, 1 process", "step_ms": round(plain_clip * 1e3, 2),
             "vs_torch": round(plain_clip / plain, 3)}]
    for name, group in (("BF16Optimizer world 1", [w1]), ("BF16Optimizer world 2", w2)):
        secs = max(r["seconds"] for r in group)
        rows.append({"system": name + " (slowest rank)", "step_ms": round(secs * 1e3, 2),
                     "vs_torch": round(secs / plain, 3)})
    for system in systems:
        res = run_world(2, args.numel, args.steps, system, args.device)
        back, step = max(r[0] for r in res), max(r[1] for r in res)
        totals[system] = back + step
        print(f"  {system:10s} backward {back * 1e3:7.1f} ms + step {step * 1e3:7.1f} ms = "
              f"{(back + step) * 1e3:7.1f} ms ({(back + step) / totals['parts']:.2f} of parts)")
    summary = {"Psi (params)": psi, "steps (fastest taken)": args.steps}
    for n, res in ((1, w1), (2, w2[0])):
        got = res["bf16"] + res["master"] + res["state"]
        summary[f"world {n}: model-state bytes per rank / (4+K)Psi/N + 2Psi"] = round(
            got / ((4 + K_ADAMW) * psi / n + 2 * psi), 4)
    summary.update({f"world 2, {s}: elementwise backward + step (ms)": round(t * 1e3, 2)
                    for s, t in totals.items()})
    record("bench_optim" + ("_cuda" if args.device == "cuda" else ""), {"rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
