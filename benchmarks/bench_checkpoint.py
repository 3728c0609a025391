"""Benchmark: parts.checkpoint vs torch.utils.checkpoint (non-reentrant) vs no checkpointing.

Same GPT-style model (pre-LN blocks with dropout), same inputs and dropout seed for the
three modes. For each mode: median forward+backward time over ``--steps`` steps (after a
warm-up step; modes interleaved step by step so machine noise hits them alike) and the
bytes made during forward that are still held when backward starts
(parts.observe.StorageTracker, measured in a separate untimed step because tracking costs
time). Also checks that the three modes give bitwise-equal input grads. Ratios are
relative to no checkpointing, all from this one run.

    python benchmarks/bench_checkpoint.py [--layers 8 --dim 256 --seq 128 --batch 4 --threads 1]
    python benchmarks/bench_checkpoint.py --device cuda   # on one GPU; records bench_checkpoint_cuda
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from record import record

from parts.checkpoint import checkpoint
from parts.observe import StorageTracker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import devices  # noqa: E402


class Block(nn.Module):
    """Pre-LN causal self-attention + MLP block with attention and residual dropout."""

    def __init__(self, dim: int, heads: int, p: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)).masked_fill(mask, -math.inf)
        y = (self.drop(att.softmax(-1)) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def wrap(mode: str):
    """How a block is called in ``mode``."""
    if mode == "none":
        return lambda block, *args: block(*args)
    if mode == "torch":
        return lambda block, *args: torch_checkpoint.checkpoint(block, *args, use_reentrant=False)
    return lambda block, *args: checkpoint(block, *args)


def step(blocks, x, mask, mode: str, tracker: StorageTracker | None = None):
    """One forward+backward; returns (input grad, bytes held at the start of backward)."""
    call = wrap(mode)
    torch.manual_seed(1)
    x = x.detach().requires_grad_()
    with tracker if tracker is not None else contextlib.nullcontext():
        h = x * 1.0
        for block in blocks:
            h = call(block, h, mask)
        loss = h.square().mean()
        del h
    gc.collect()
    held = tracker.live_bytes() if tracker is not None else 0
    loss.backward()
    return x.grad, held


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``args.device`` comes back resolved to ``cpu`` or ``cuda``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (1: OpenMP spin-waits distort timings on a busy box)")
    return devices.parse_with_device(ap, argv)


def main() -> None:
    """Run the three modes and print times, held bytes and ratios."""
    args = parse_args()
    device = devices.pick(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(args.dim, args.heads) for _ in range(args.layers)).to(device)
    x, mask = devices.to(device, torch.randn(args.batch, args.seq, args.dim),
                         torch.ones(args.seq, args.seq, dtype=torch.bool).triu(1))
    modes = ["none", "torch", "parts"]
    grads, held, times = {}, {}, {m: [] for m in modes}
    for mode in modes:
        grads[mode], held[mode] = step(blocks, x, mask, mode, StorageTracker())
        step(blocks, x, mask, mode)  # warm-up
    for _ in range(args.steps):  # modes interleaved so that machine noise hits them alike
        for mode in modes:
            devices.sync(device)
            start = time.perf_counter()
            step(blocks, x, mask, mode)
            devices.sync(device)
            times[mode].append(time.perf_counter() - start)
    results = {m: (statistics.median(times[m]), held[m]) for m in modes}
    print(f"model: {args.layers} blocks, dim {args.dim}, seq {args.seq}, batch {args.batch}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} timed steps, on {device}")
    base_t, base_b = results["none"]
    print(f"{'mode':<8}{'step (s)':>10}{'vs none':>9}{'held MiB':>10}{'vs none':>9}")
    for mode in modes:
        t, b = results[mode]
        print(f"{mode:<8}{t:>10.3f}{t / base_t:>9.2f}{b / 2**20:>10.2f}{b / base_b:>9.3f}")
    t_parts, b_parts = results["parts"]
    t_torch, b_torch = results["torch"]
    print(f"parts vs torch.utils.checkpoint: time {t_parts / t_torch:.2f}x, "
          f"held bytes {b_parts / b_torch:.3f}x")
    same = all(torch.equal(grads["none"], grads[m]) for m in modes)
    print(f"input grads bitwise equal across modes: {same}")
    rows = [{"mode": m, "step_s": round(results[m][0], 4), "vs_none": round(results[m][0] / base_t, 3),
             "held_MiB": round(results[m][1] / 2**20, 2), "held_vs_none": round(results[m][1] / base_b, 4)}
            for m in modes]
    record("bench_checkpoint" + ("_cuda" if args.device == "cuda" else ""), {"rows": rows, "summary": {
        "parts vs torch.utils.checkpoint (time)": round(t_parts / t_torch, 3),
        "input grads bitwise equal across modes": same}})


if __name__ == "__main__":
    main()
