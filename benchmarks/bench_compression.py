"""Compressed collectives measured: loss curves and bytes with ``Compression`` off / weights / weights + grads.

    python benchmarks/bench_compression.py                       # the recipe's GPT, world 4, 200 steps
    python benchmarks/bench_compression.py --model 25m --steps 30  # the 25M GPT of bench_zero3
                                                                   # (recorded as bench_compression_25m)
    python benchmarks/bench_compression.py --device cuda         # four GPUs, NCCL; records bench_compression_cuda

One run of four ranks (gloo) trains the same GPT (recipes/gpt_model.py) from the same seed on
the same batches of Python text from the standard library (recipes/chardata.py: random tokens
would hide a precision gap), AdamW (lr 1e-3, betas 0.9/0.95, weight decay 0.1), fp32, in each
layout (``full``: sharded over the 4 ranks; ``hybrid``: 2 x 2, sharded within pairs, replicated
across) and each setting: compression off, int8 weights, int8 weights + int8 grads (error
feedback), int8 weights + int4 grads; all ``on="all"``. Per row: the final loss (mean of the
last 10 steps' loss, averaged over ranks), its difference from the uncompressed run of that
layout, the largest difference of any single step, rank 0's bytes per step by kind against
the uncompressed run's (the byte ledger: what the codes and scales take on the wire), the
error-feedback residual memory and the median step time (a shared machine: read ratios).
"""

from __future__ import annotations

import argparse
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

MODELS = {"recipe": dict(n_layer=4, n_embd=128, n_head=4, seq=64),  # recipes/train_gpt.py's default GPT
          "25m": dict(n_layer=8, n_embd=512, n_head=8, seq=128)}  # bench_zero3's 25.4M GPT
SETTINGS = {"off": None, "w8": dict(weights="int8"), "w8g8": dict(weights="int8", grads="int8"),
            "w8g4": dict(weights="int8", grads="int4")}
KINDS = ("allgather_bytes", "reduce_scatter_bytes", "all_reduce_bytes")
TAIL = 10  # steps averaged into the final loss
_DEVICE = [torch.device("cpu")]  # this rank's device, set from --device


def _layout(name: str) -> dict:
    if name == "full":
        return {}
    from torch.distributed.device_mesh import init_device_mesh
    shape = (2, dist.get_world_size() // 2)
    return {"mesh": init_device_mesh(_DEVICE[0].type, shape, mesh_dim_names=("replicate", "shard"))}


def _batches(config: GPTConfig, steps: int, batch: int, rank: int) -> list:
    from chardata import batch as make_batch, load_splits
    generator = torch.Generator().manual_seed(1000 + rank)
    tokens = load_splits(None)[0]
    return [make_batch(tokens, batch, config.block_size, generator) for _ in range(steps)]


def _train(layout: str, setting: str, config: GPTConfig, batches: list) -> dict:
    """One run: the mean loss over ranks per step, rank 0's bytes per kind, residual bytes, step times."""
    from parts.comm import comm_counter
    from parts.partition import Compression, attach, partitioned, shards
    torch.manual_seed(0)
    with partitioned(device=_DEVICE[0], **_layout(layout)):
        model = GPT(config)
    spec = SETTINGS[setting]
    coordinator = attach(model, compression=Compression(**spec) if spec else None)
    optimizer = torch.optim.AdamW(shards(model), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    losses, times = [], []
    before = comm_counter.snapshot()
    for inputs, targets in batches:
        inputs, targets = devices.to(_DEVICE[0], inputs, targets)
        devices.sync(_DEVICE[0])
        started = time.perf_counter()
        loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        devices.sync(_DEVICE[0])
        times.append(time.perf_counter() - started)
        losses.append(loss.detach())
    moved = {k: (comm_counter.snapshot()[k] - before[k]) // len(batches) for k in KINDS}
    curve = torch.stack(losses)
    dist.all_reduce(curve)
    return dict(curve=(curve / dist.get_world_size()).tolist(), bytes=moved,
                residual=coordinator.stats().residual_bytes, step=statistics.median(times[2:] or times))


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    torch.set_num_threads(1)
    _DEVICE[0] = devices.init_spawned(args.device, rank, world, port)  # gloo, or NCCL on GPU ``rank``
    shape = MODELS[args.model]
    config = GPTConfig(block_size=shape["seq"], n_layer=shape["n_layer"], n_head=shape["n_head"],
                       n_embd=shape["n_embd"])
    batches = _batches(config, args.steps, args.batch, rank)
    for layout in args.layouts:
        for setting in args.settings:
            result = _train(layout, setting, config, batches)
            if rank == 0:
                out[(layout, setting)] = result
                print(f"{layout} {setting}: final {sum(result['curve'][-TAIL:]) / TAIL:.4f}, "
                      f"step {result['step']:.3f} s", flush=True)
    dist.destroy_process_group()


def _rows(results: dict, args: argparse.Namespace) -> list[dict]:
    rows = []
    for (layout, setting), r in results.items():
        base = results[(layout, "off")]
        final, final_off = sum(r["curve"][-TAIL:]) / TAIL, sum(base["curve"][-TAIL:]) / TAIL
        worst = max(abs(a - b) / b for a, b in zip(r["curve"], base["curve"]))
        row = dict(layout=layout, setting=setting, final_loss=round(final, 4),
                   final_vs_off=f"{100 * (final - final_off) / final_off:+.3f}%",
                   worst_step_vs_off=f"{100 * worst:.3f}%")
        for kind in KINDS:  # "-": the layout has no such collective
            ratio = r["bytes"][kind] / base["bytes"][kind] if base["bytes"][kind] else None
            row[f"{kind.split('_bytes')[0]}_vs_off"] = "-" if ratio is None else round(ratio, 3)
        row.update(residual_MiB=round(r["residual"] / 2 ** 20, 2), step_s=round(r["step"], 3),
                   step_vs_off=round(r["step"] / base["step"], 2))
        rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``args.device`` comes back resolved to ``cpu`` or ``cuda``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="recipe")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--layouts", nargs="+", default=["full", "hybrid"], choices=["full", "hybrid"])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--no-record", action="store_true")
    return devices.parse_with_device(parser, argv)


def main() -> None:
    """Run every layout and setting in one 4-rank job, print and record the table."""
    args = parse_args()
    if "off" not in args.settings:
        args.settings.insert(0, "off")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    started = time.perf_counter()
    mp.spawn(_worker, args=(4, port, args, out), nprocs=4, join=True)
    rows = _rows(dict(out), args)
    for row in rows:
        print(row)
    summary = {"model": f"{args.model} GPT ({MODELS[args.model]})", "steps": args.steps,
               "sequences per rank and step": args.batch, "wall_s": round(time.perf_counter() - started)}
    if not args.no_record:
        name = "bench_compression" + "".join(f"_{v}" for v, default in ((args.model, "recipe"), (args.device, "cpu"))
                                             if v != default)
        record(name, {"rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
