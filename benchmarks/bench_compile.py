"""Step time of a small GPT with torch.compile: parts eager, parts + ``compile_blocks``, parts +
``torch.compile(model)``, FSDP2 eager and FSDP2 + per-block ``compile``, side by side in one run
(world 2, fp32, SGD).

    torchrun --nproc-per-node 2 benchmarks/bench_compile.py [--steps 8 --n-embd 128 --layers 4]
    torchrun --nproc-per-node 2 benchmarks/bench_compile.py --device cuda   # NCCL; records bench_compile_cuda

Every system trains the same GPT (recipes/gpt_model.py) from the same seed on the same
batches; the first ``--warmup`` steps (which compile) are not timed. Prints per system the
median step wall time, rank 0's CPU time per step (``time.process_time``: less sensitive to
other jobs' load than wall time), the ratio to parts eager, and the final loss (compiled
systems agree with eager to ~1e-5, not bitwise: inductor fuses fp32 math).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import devices  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402
from record import record  # noqa: E402

from parts.partition import attach, compile_blocks, partitioned, shards  # noqa: E402

_DEVICE = [torch.device("cpu")]  # this rank's device, set from --device


def _parts(config: GPTConfig, compiled: object) -> tuple:
    """A parts ZeRO-3 model (every parameter fetched per block) and its optimizer; ``compiled``:
    False, "blocks" (``compile_blocks``) or "model" (``torch.compile(model)``)."""
    torch.manual_seed(0)
    with partitioned(device=_DEVICE[0]):
        model = GPT(config)
    attach(model, persistence_threshold=0)
    opt = torch.optim.SGD(shards(model), lr=0.1)
    if compiled == "blocks":
        compile_blocks(model, model.blocks)
    return (torch.compile(model) if compiled == "model" else model), opt


def _fsdp(config: GPTConfig, compiled: bool) -> tuple:
    """FSDP2 ``fully_shard`` per block and on the root; each block compiled if asked."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = GPT(config).to(_DEVICE[0])
    for block in model.blocks:
        fully_shard(block)
        if compiled:
            block.compile()
    fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _batch(step: int, config: GPTConfig, rows: int) -> tuple:
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, config.vocab_size, (rows * dist.get_world_size(), config.block_size), generator=g)
    r = dist.get_rank()
    return devices.to(_DEVICE[0], idx[r * rows:(r + 1) * rows], idx.roll(-1, dims=1)[r * rows:(r + 1) * rows])


def _measure(build, config: GPTConfig, args: argparse.Namespace, compiled: bool) -> dict:
    """Train ``warmup + steps`` steps; wall and CPU time of the timed ones, final global loss."""
    model, opt = build(config, compiled)
    walls, cpus, loss = [], [], None
    for step in range(args.warmup + args.steps):
        dist.barrier()
        devices.sync(_DEVICE[0])
        wall, cpu = time.perf_counter(), time.process_time()
        loss = model(*_batch(step, config, args.rows))
        loss.backward()
        opt.step()
        opt.zero_grad()
        devices.sync(_DEVICE[0])
        if step >= args.warmup:
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return dict(wall=statistics.median(walls), cpu=statistics.median(cpus),
                loss=(mean / dist.get_world_size()).item())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``args.device`` comes back resolved to ``cpu`` or ``cuda``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    return devices.parse_with_device(parser, argv)


def main() -> None:
    """Run the five systems in turn and print the table on rank 0."""
    args = parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.")
    _DEVICE[0] = devices.init(args.device)  # gloo, or NCCL on LOCAL_RANK's GPU
    torch.set_num_threads(1)
    config = GPTConfig(vocab_size=128, block_size=64, n_layer=args.layers, n_head=4, n_embd=args.n_embd)
    results = {}
    for name, build, compiled in (("parts eager", _parts, False), ("parts + compile_blocks", _parts, "blocks"),
                                  ("parts + torch.compile(model)", _parts, "model"),
                                  ("FSDP2 eager", _fsdp, False), ("FSDP2 + block.compile()", _fsdp, True)):
        if dist.get_rank() == 0:
            print(f"running {name} ...", flush=True)
        torch.compiler.reset()
        results[name] = _measure(build, config, args, compiled)
    if dist.get_rank() == 0:
        base = results["parts eager"]["wall"]
        print(f"{'system':30s} {'step (s)':>9s} {'cpu/step (s)':>12s} {'x parts eager':>13s} {'final loss':>11s}")
        for name, r in results.items():
            print(f"{name:30s} {r['wall']:9.4f} {r['cpu']:12.4f} {r['wall'] / base:13.2f} {r['loss']:11.6f}")
        record("bench_compile" + ("_cuda" if args.device == "cuda" else ""), {"rows": [
            {"system": name, "step_s": round(r["wall"], 4), "cpu_per_step_s": round(r["cpu"], 4),
             "vs_parts_eager": round(r["wall"] / base, 3), "final_loss": round(r["loss"], 6)}
            for name, r in results.items()]})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
