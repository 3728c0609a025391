"""Training step time, peak memory and communication: parts ZeRO-3 vs FSDP2, DeepSpeed ZeRO-3 and DDP, side by side.

    python benchmarks/bench_zero3.py                      # 25.4M-param GPT, fp32, world 2
    python benchmarks/bench_zero3.py --n-embd 256 --steps 6   # quicker
    python benchmarks/bench_zero3.py --dtype bf16         # bf16 ZeRO-3 vs FSDP2 bf16, vs the fp32 loss
    python benchmarks/bench_zero3.py --device cuda        # one GPU per rank, NCCL (DeepSpeed: its CUDA accelerator)

Every system trains the same GPT (recipes/gpt_model.py) from the same seed on the same
batches, AdamW, fp32, in fresh processes (so peak RSS is each system's own), one system
after the other in one invocation, ``--rounds`` times in turn (so load drift on a shared
machine hits all systems alike). Prints the median step time, the ratio to DDP, peak RSS
per rank, and the final loss (all systems must agree), then the hooks' host overhead.
DeepSpeed ZeRO-3 (``deepspeed``, default knobs, its CPU accelerator on the same gloo group)
joins the fp32 systems where ``deepspeed`` is importable (``pip install deepspeed``). Beside
the wall time, each step's CPU time of rank 0's process (all its threads, ``time.process_time``):
on a machine shared with other jobs wall time swings with their load, CPU time much less.

``--dtype bf16``: DDP in fp32 is the reference loss; FSDP2 with bf16
params and fp32 reduce (``MixedPrecisionPolicy``) and parts with ``MixedPrecision()`` (fp32
shards gathered as bf16, grads summed in fp32) train the same model on Python text
from the standard library (recipes/chardata.py: random tokens would hide the precision gap)
with AdamW(lr 3e-4, betas 0.9/0.95, weight decay 0.1), 3 + 20 steps; the table adds each
system's final loss against the fp32 one.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import devices  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402
from record import record  # noqa: E402

SYSTEMS = ("ddp", "fsdp2", "parts", "parts_lean", "parts_defaults") + (
    ("deepspeed",) if importlib.util.find_spec("deepspeed") else ())  # DeepSpeed ZeRO-3 where installed
MODELS = {"25m": dict(n_layer=8, n_embd=512, n_head=8, seq=128),  # ../shared/LESSONS.md's 25.4M GPT
          "small": dict(n_layer=32, n_embd=64, n_head=4, seq=64)}  # small and deep, 1.6M
_DEVICE = [torch.device("cpu")]  # this worker's device, set by _worker from --device
BF16_SYSTEMS = ("ddp", "fsdp2_bf16", "parts_bf16", "parts_lean_bf16")
ANCHOR_ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)  # the bf16 comparison's optimizer


def build_ddp(config):
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(GPT(config).to(_DEVICE[0]))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4), None


def _mesh():
    """FSDP2's mesh over every rank, on the benchmark's device type (not the one torch finds)."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(_DEVICE[0].type, (dist.get_world_size(),))


def build_fsdp2(config):
    from torch.distributed.fsdp import fully_shard
    model, mesh = GPT(config).to(_DEVICE[0]), _mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4), None


def build_deepspeed(config):
    """DeepSpeed ZeRO-3 with its default knobs (fp32, torch AdamW as the client optimizer)."""
    import deepspeed  # DS_ACCELERATOR=cpu is set by main(); deepspeed reuses the gloo group
    model = GPT(config)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                 "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
    engine, optimizer, _, _ = deepspeed.initialize(model=model,
                                                   optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4),
                                                   config=ds_config)
    return _DeepSpeedModel(engine), _DeepSpeedOptimizer(engine), None


class _DeepSpeedModel:
    """The training loop's ``model(x, y)`` / ``loss.backward()`` on a DeepSpeed engine."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __call__(self, inputs, targets):
        loss = self.engine(inputs, targets)
        engine = self.engine
        return _Loss(loss, engine)


class _Loss:
    """A loss whose ``backward()`` is the engine's (DeepSpeed scales and reduces in it)."""

    def __init__(self, loss, engine) -> None:
        self.loss, self.engine = loss, engine

    def backward(self) -> None:
        self.engine.backward(self.loss)

    def detach(self):
        return self.loss.detach()


class _DeepSpeedOptimizer:
    """``optimizer.step()`` / ``zero_grad()`` as the engine's step."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # engine.step() clears the grads


def build_parts(config):
    from parts.partition import attach, partitioned, shards
    with partitioned(device=_DEVICE[0]):
        model = GPT(config)
    coordinator = attach(model, persistence_threshold=0)
    return model, torch.optim.AdamW(shards(model), lr=3e-4), coordinator


def build_parts_defaults(config):
    """ZeRO-3 with every knob at its default (fetch units, persistence threshold)."""
    from parts.partition import attach, partitioned, shards
    with partitioned(device=_DEVICE[0]):
        model = GPT(config)
    return model, torch.optim.AdamW(shards(model), lr=3e-4), attach(model)


def build_parts_lean(config):
    """ZeRO-3 with a tight budget: about two blocks live, release after every use (3Ψ traffic)."""
    from parts.partition import attach, partitioned, shards
    with partitioned(device=_DEVICE[0]):
        model = GPT(config)
    block = 12 * config.n_embd ** 2
    coordinator = attach(model, persistence_threshold=0, max_reuse_distance=0, prefetch_bucket_size=block,
                         max_live_parameters=2 * block, reduce_bucket_size=block)
    return model, torch.optim.AdamW(shards(model), lr=3e-4), coordinator


def _bf16_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def build_fsdp2_bf16(config):
    """FSDP2's mixed precision: fp32 sharded params, bf16 compute, fp32 grad reduction."""
    from torch.distributed.fsdp import fully_shard
    model, mesh = GPT(config).to(_DEVICE[0]), _mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=_bf16_policy())
    fully_shard(model, mesh=mesh, mp_policy=_bf16_policy())
    return model, torch.optim.AdamW(model.parameters(), **ANCHOR_ADAMW), None


def _parts_bf16(config, **knobs):
    from parts.partition import MixedPrecision, attach, partitioned, shards
    with partitioned(device=_DEVICE[0]):  # fp32 shards: the masters
        model = GPT(config)
    coordinator = attach(model, mixed_precision=MixedPrecision(), **knobs)
    return model, torch.optim.AdamW(shards(model), **ANCHOR_ADAMW), coordinator


def build_parts_bf16(config):
    """parts' MixedPrecision policy with the knobs of ``parts``."""
    return _parts_bf16(config, persistence_threshold=0)


def build_parts_lean_bf16(config):
    """parts' MixedPrecision policy with the knobs of ``parts_lean``."""
    block = 12 * config.n_embd ** 2
    return _parts_bf16(config, persistence_threshold=0, max_reuse_distance=0, prefetch_bucket_size=block,
                       max_live_parameters=2 * block, reduce_bucket_size=block)


def _ddp_anchor(config):
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(GPT(config).to(_DEVICE[0]))
    return model, torch.optim.AdamW(model.parameters(), **ANCHOR_ADAMW), None


def _batches(config, args, rank):
    if args.dtype == "bf16":
        from chardata import batch, load_splits
        generator = torch.Generator().manual_seed(1000 + rank)
        tokens = load_splits(None)[0]
        return [batch(tokens, args.batch, config.block_size, generator) for _ in range(args.steps)]
    generator = torch.Generator().manual_seed(1000 + rank)
    shape = (args.batch, config.block_size)
    return [(torch.randint(config.vocab_size, shape, generator=generator),
             torch.randint(config.vocab_size, shape, generator=generator)) for _ in range(args.steps)]


def _worker(rank, world_size, port, system, config, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    device = _DEVICE[0] = devices.init(args.device)  # the environment above: gloo, or NCCL on LOCAL_RANK's GPU
    if args.mmap_threshold:
        from parts.observe import set_mmap_threshold
        set_mmap_threshold(args.mmap_threshold)  # freed large buffers leave the process (all systems)
    torch.manual_seed(0)
    build = _ddp_anchor if (system, args.dtype) == ("ddp", "bf16") else globals()[f"build_{system}"]
    model, optimizer, coordinator = build(config)
    times, cpu_times, loss = [], [], None
    for inputs, targets in _batches(config, args, rank):
        inputs, targets = devices.to(device, inputs, targets)
        _sync(device)
        started, cpu_started = time.perf_counter(), time.process_time()
        loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - cpu_started)
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    stats = coordinator.stats() if coordinator is not None else None
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if rank == 0:
        results[system] = dict(step=statistics.median(times[2:] or times),
                               cpu=statistics.median(cpu_times[2:] or cpu_times), peak_rss=peak_rss,
                               loss=loss.item() / world_size, stats=stats)
        if device.type == "cuda":
            results[system] = dict(results[system], peak_gpu=torch.cuda.max_memory_allocated(device))
    # DDP (the anchor) holds its group strongly from inside reference cycles: freed here, so
    # destroy_process_group joins gloo's workers before interpreter teardown
    del model, optimizer, coordinator
    gc.collect()
    dist.destroy_process_group()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``args.device`` comes back resolved to ``cpu`` or ``cuda``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="25m",
                        help="shape preset (n_layer, n_embd, n_head, seq); the flags below override it")
    parser.add_argument("--n-embd", type=int, default=None)
    parser.add_argument("--n-layer", type=int, default=None)
    parser.add_argument("--n-head", type=int, default=None)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="default 10 (fp32), 23 (bf16)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--systems", default=None,
                        help=f"default {','.join(SYSTEMS)} (fp32), {','.join(BF16_SYSTEMS)} (bf16)")
    parser.add_argument("--mmap-threshold", type=int, default=128 * 1024,
                        help="bytes; every system's processes get parts.observe.set_mmap_threshold(N) "
                             "(0: glibc's dynamic default)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="run every system this many times, alternating; report the median")
    parser.add_argument("--no-overhead", action="store_true", help="skip the world-1 host-overhead run")
    return devices.parse_with_device(parser, argv)


def main() -> None:
    args = parse_args()
    os.environ.setdefault("DS_ACCELERATOR", args.device)  # DeepSpeed's, for the deepspeed system
    for name, value in MODELS[args.model].items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    bf16 = args.dtype == "bf16"
    args.steps = args.steps or (23 if bf16 else 10)
    args.systems = args.systems or ",".join(BF16_SYSTEMS if bf16 else SYSTEMS)
    if bf16:
        from chardata import VOCAB_SIZE
    config = GPTConfig(vocab_size=VOCAB_SIZE if bf16 else 128, block_size=args.seq, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    params = sum(p.numel() for p in GPT(config).parameters())
    print(f"GPT {params / 1e6:.1f}M params, world {args.world_size}, micro-batch "
          f"{args.batch}x{args.seq} per rank, {'bf16 (DDP: fp32 reference)' if bf16 else 'fp32'} AdamW, "
          f"{args.steps} steps, {'stdlib text' if bf16 else 'random tokens'}, "
          f"mmap threshold {args.mmap_threshold or 'glibc default'}")
    results, runs = mp.Manager().dict(), {}
    for round_no in range(args.rounds):  # systems alternate, so load drift hits them alike
        for system in args.systems.split(","):
            mp.spawn(_worker, args=(args.world_size, _free_port(), system, config, args, results),
                     nprocs=args.world_size)
            runs.setdefault(system, []).append(results[system])
            row = results[system]
            print(f"  round {round_no + 1}/{args.rounds} {system}: {row['step']:.3f} s (CPU {row['cpu']:.3f} s), "
                  f"peak RSS {row['peak_rss'] / 2**20:.0f} MiB, loss {row['loss']:.4f}, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    table = _print_table({system: _combine(rows) for system, rows in runs.items()}, params)
    paired = _print_paired(runs)
    summary = {"model": f"GPT {params / 1e6:.1f}M params, world {args.world_size}, micro-batch "
                        f"{args.batch}x{args.seq} per rank, {args.dtype} AdamW, {args.steps} steps",
               "rounds": args.rounds, "mmap threshold": args.mmap_threshold or "glibc default"}
    summary.update({f"{system} vs DDP round by round": r for system, r in paired.items()})
    if not args.no_overhead:
        summary.update(_print_overhead())
    suffix = "".join(f"_{v}" for v, default in ((args.model, "25m"), (args.dtype, "fp32"), (args.device, "cpu"))
                     if v != default)
    record("bench_zero3" + suffix, {"rows": table, "summary": summary})


def _print_overhead() -> dict:
    """Host cost of the coordinator's hooks per submodule call, communication made free (world 1)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_overlap import host_overhead
    rows = host_overhead(fsdp2=True)
    print("\nHost overhead per module call (world 1: collectives are local copies; "
          "200 x Linear(16, 16), bench_overlap.py; FSDP2: every Linear fully_shard, same calls):")
    for setting in ("persistent", "fetch_release", "fsdp2"):
        print(f"  {setting}: {rows[setting]['per_call_us']:.0f} µs")
    return {f"host overhead per module call, {s} (µs)": round(rows[s]["per_call_us"]) for s in
            ("persistent", "fetch_release", "fsdp2")}


def _combine(rows: list) -> dict:
    """One system's runs: median of the per-run median step times, the highest peak RSS."""
    losses = {row["loss"] for row in rows}
    if len(losses) != 1:
        raise RuntimeError(f"runs of one system disagree on the final loss: {sorted(losses)}")
    gpu = {"peak_gpu": max(row["peak_gpu"] for row in rows)} if "peak_gpu" in rows[0] else {}
    return dict(step=statistics.median(row["step"] for row in rows),
                cpu=statistics.median(row["cpu"] for row in rows),
                peak_rss=max(row["peak_rss"] for row in rows), loss=losses.pop(), stats=rows[-1]["stats"], **gpu)


def _print_table(results, params) -> list[dict]:
    ddp, fsdp2 = results.get("ddp", {}), results.get("fsdp2") or results.get("fsdp2_bf16") or {}
    deepspeed = results.get("deepspeed", {})
    print("\n| system | step (s) | vs DDP | vs FSDP2 | vs DeepSpeed | CPU s / step (rank 0) | CPU vs DDP | "
          "peak RSS / rank (MiB) | final loss | vs DDP loss | gathered + reduce-scattered per step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    table = []
    for system, row in results.items():
        ratios = [f"{row['step'] / base['step']:.2f}" if base else "-" for base in (ddp, fsdp2, deepspeed)]
        cpu_ratio = f"{row['cpu'] / ddp['cpu']:.2f}" if ddp else "-"
        gap = f"{100 * (row['loss'] / ddp['loss'] - 1):+.3f}%" if ddp else "-"
        print(f"| {system} | {row['step']:.3f} | {ratios[0]} | {ratios[1]} | {ratios[2]} | {row['cpu']:.3f} | "
              f"{cpu_ratio} | {row['peak_rss'] / 2**20:.0f} | {row['loss']:.4f} | {gap} | "
              f"{_traffic(row.get('stats'), params)} |")
        table.append({"system": system, "step_s": round(row["step"], 3), "vs_DDP": ratios[0], "vs_FSDP2": ratios[1],
                      "vs_DeepSpeed": ratios[2],
                      "cpu_s_per_step_rank0": round(row["cpu"], 3), "cpu_vs_DDP": cpu_ratio,
                      "peak_rss_MiB": round(row["peak_rss"] / 2**20), "final_loss": round(row["loss"], 4),
                      "loss_vs_DDP": gap, "traffic_per_step": _traffic(row.get("stats"), params)})
        if "peak_gpu" in row:
            table[-1]["peak_gpu_allocated_MiB"] = round(row["peak_gpu"] / 2**20)
    return table


def _print_paired(runs: dict) -> dict[str, str]:
    """Each system's step time over DDP's in the same round: how much of a ratio is noise."""
    if "ddp" not in runs or len(runs["ddp"]) < 2:
        return {}
    paired = {}
    print("\nvs DDP round by round (same round, so drift in machine load cancels):")
    for system, rows in runs.items():
        if system != "ddp":
            ratios = [row["step"] / base["step"] for row, base in zip(rows, runs["ddp"])]
            paired[system] = " ".join(f"{r:.2f}" for r in ratios) + f" (median {statistics.median(ratios):.2f})"
            print(f"  {system}: {paired[system]}")
    return paired


def _traffic(stats, params) -> str:
    """Bytes moved by one rank per step, in units of the fp32 model size Ψ (x (w-1)/w)."""
    if not stats:
        return "-"
    psi = 4 * params
    return (f"{stats.allgather_bytes / psi:.2f}Ψ + {stats.reduce_scatter_bytes / psi:.2f}Ψ "
            f"(live high-water {stats.live_high_water / params:.0%} of params)")


if __name__ == "__main__":
    main()
