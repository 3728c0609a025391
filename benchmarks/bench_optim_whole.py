"""Muon + AdamW on ZeRO-3 shards against AdamW alone: step time and bytes per step, beside FSDP2.

    python benchmarks/bench_optim_whole.py --world-size 2
    python benchmarks/bench_optim_whole.py --world-size 4 --steps 5
    python benchmarks/bench_optim_whole.py --device cuda   # one GPU per rank, NCCL; records ..._cuda

The 25.4M GPT of recipes/gpt_model.py (8 layers, 512 wide, sequence 128), fp32, the same seed and
batches for every system, each in fresh processes, one after the other:
- ``parts_adamw``: ``torch.optim.AdamW(shards(model))``, the shard path;
- ``parts_muon``: ``torch.optim.Muon`` over the blocks' 2-D weights (the whole-tensor path: each
  matrix stepped whole by an owner rank) plus AdamW over the embeddings, biases and norms;
- ``fsdp2_adamw`` / ``fsdp2_muon``: the same optimizers on FSDP2 (``fully_shard`` per block) DTensors.
Bytes are parts' ledger (``parts.comm.comm_counter``, rank 0, all kinds) per steady-state step;
FSDP2's collectives are not in it. Step time is the median after two warm-up steps.
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

SYSTEMS = ("parts_adamw", "parts_muon", "fsdp2_adamw", "fsdp2_muon")


def _is_muon(name: str, shape: tuple) -> bool:
    """Muon's share (nanoGPT practice): the blocks' 2-D weights; embeddings and the rest take AdamW."""
    return len(shape) == 2 and "wte" not in name and "wpe" not in name and "head" not in name


def _optimizers(named: list, muon: bool) -> list:
    if not muon:
        return [torch.optim.AdamW([p for _, p, _ in named], lr=3e-4)]
    return [torch.optim.Muon([p for n, p, s in named if _is_muon(n, s)], lr=2e-2),
            torch.optim.AdamW([p for n, p, s in named if not _is_muon(n, s)], lr=3e-4)]


def build(system: str, config: GPTConfig, device: torch.device):
    model = GPT(config).to(device)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if system.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        named = [(n, p, shapes[n]) for n, p in model.named_parameters()]
        return model, _optimizers(named, system.endswith("muon"))
    from parts.partition import attach, partition_module, shards
    partition_module(model)
    attach(model)
    named = [(n, shards([p])[0], shapes[n]) for n, p in model.named_parameters()]
    return model, _optimizers(named, system.endswith("muon"))


def _ledger_bytes() -> int:
    from parts.comm import comm_counter
    return sum(v for k, v in comm_counter.snapshot().items() if k.endswith("_bytes"))


def _worker(rank: int, world: int, port: int, system: str, config: GPTConfig, args, results) -> None:
    torch.set_num_threads(1)
    device = devices.init_spawned(args.device, rank, world, port)  # gloo, or NCCL on GPU ``rank``
    torch.manual_seed(0)
    model, opts = build(system, config, device)
    gen = torch.Generator().manual_seed(1000 + rank)
    times, moved, loss = [], [], None
    for _ in range(args.steps):
        x, y = (torch.randint(config.vocab_size, (args.batch, config.block_size), generator=gen) for _ in range(2))
        x, y = devices.to(device, x, y)
        devices.sync(device)
        before, started = _ledger_bytes(), time.perf_counter()
        loss = model(x, y)
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        devices.sync(device)
        times.append(time.perf_counter() - started)
        moved.append(_ledger_bytes() - before)
    total = loss.detach().clone()
    dist.all_reduce(total)
    if rank == 0:
        results[system] = {"step_s": statistics.median(times[2:]), "bytes": statistics.median(moved[2:]),
                           "loss": total.item() / world}
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``args.device`` comes back resolved to ``cpu`` or ``cuda``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--n-embd", type=int, default=512, help="512: the 25.4M GPT; smaller for a smoke run")
    parser.add_argument("--n-layer", type=int, default=8)
    return devices.parse_with_device(parser, argv)


def main() -> None:
    args = parse_args()
    config = GPTConfig(vocab_size=128, block_size=128, n_layer=args.n_layer, n_head=8, n_embd=args.n_embd)
    params = sum(p.numel() for p in GPT(config).parameters())
    results, rows = mp.Manager().dict(), []
    for system in args.systems.split(","):
        mp.spawn(_worker, args=(args.world_size, _free_port(), system, config, args, results), nprocs=args.world_size)
        r = dict(results[system])
        print(f"{system}: {r['step_s']:.3f} s, {r['bytes'] / 2**20:.1f} MiB per step, loss {r['loss']:.4f}", flush=True)
        rows.append({"system": system, "step_s": round(r["step_s"], 3),
                     "ledger_MiB_per_step": round(r["bytes"] / 2**20, 1) if system.startswith("parts") else "n/a",
                     "final_loss": round(r["loss"], 4)})
    by = {row["system"]: row for row in rows}
    summary = {"model": f"GPT {params / 1e6:.1f}M params, world {args.world_size}, micro-batch "
                        f"{args.batch}x{config.block_size} per rank, fp32, {args.steps} steps"}
    if "parts_adamw" in by and "parts_muon" in by:
        summary["parts Muon+AdamW / AdamW bytes"] = round(
            by["parts_muon"]["ledger_MiB_per_step"] / by["parts_adamw"]["ledger_MiB_per_step"], 3)
        summary["parts Muon+AdamW / AdamW step"] = round(by["parts_muon"]["step_s"] / by["parts_adamw"]["step_s"], 3)
    print(summary)
    if (args.n_embd, args.n_layer) != (512, 8):
        return  # a smoke run: not recorded
    suffix = "_cuda" if args.device == "cuda" else ""
    record(f"bench_optim_whole_world{args.world_size}{suffix}", {"rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
