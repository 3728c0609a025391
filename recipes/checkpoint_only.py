"""Activation checkpointing alone: what a transformer keeps from forward to backward.

    torchrun --standalone --nproc-per-node 2 recipes/checkpoint_only.py
    torchrun --standalone --nproc-per-node 2 recipes/checkpoint_only.py --layers 8 --seq-len 256
    torchrun --standalone --nproc-per-node 2 recipes/checkpoint_only.py --device cuda   # a GPU per rank

The same stack of GPT blocks (with dropout) runs one forward+backward four ways: without
checkpointing; with ``parts.checkpoint.checkpoint`` around each block (only block inputs are
kept, everything else is recomputed in backward); with those inputs partitioned over the
ranks (``CheckpointPolicy(partition_group=WORLD)``: each rank keeps a 1/N share and the
share is all-gathered back in backward); and partitioned plus ``cpu_offload``. Partitioning
needs the same activations on every rank (model-parallel replicas), so every rank uses the
same seed and data here. Saved bytes are the storages made during forward that are still
alive when backward starts (``StorageTracker``); the grads are compared with the plain run.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn

import devices
from gpt_model import Block, GPTConfig
from parts.checkpoint import CheckpointPolicy, checkpoint
from parts.observe import StorageTracker


def parse_args() -> argparse.Namespace:
    """Command-line knobs (defaults run in seconds on 2 CPU ranks)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.1, help="replayed exactly in recompute")
    ap.add_argument("--seed", type=int, default=1234)
    devices.add_device_flag(ap)
    return ap.parse_args()


def policies(world: dist.ProcessGroup) -> dict[str, CheckpointPolicy | None]:
    """The ways to run each block: None means no checkpointing."""
    return {"no checkpointing": None,
            "checkpoint": CheckpointPolicy(),
            "checkpoint + partitioned": CheckpointPolicy(partition_group=world),
            "checkpoint + partitioned + cpu_offload": CheckpointPolicy(partition_group=world,
                                                                       cpu_offload=True)}


def forward_backward(blocks: nn.ModuleList, x: torch.Tensor, policy: CheckpointPolicy | None,
                     seed: int) -> tuple[int, float, list[torch.Tensor]]:
    """One step: saved bytes at the start of backward, its time, and the parameter grads."""
    blocks.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in every mode
    started = time.perf_counter()
    with StorageTracker() as tracker:
        h = x
        for block in blocks:
            h = block(h) if policy is None else checkpoint(block, h, policy=policy)
        loss = h.float().square().mean()
    saved = tracker.live_bytes()
    loss.backward()
    elapsed = time.perf_counter() - started
    return saved, elapsed, [p.grad.clone() for p in blocks.parameters()]


def main() -> None:
    args = parse_args()
    device = devices.init(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # same weights and input on every rank: activations are replicas
    config = GPTConfig(n_embd=args.n_embd, n_head=args.n_head, block_size=args.seq_len,
                       dropout=args.dropout)
    blocks = nn.ModuleList(Block(config) for _ in range(args.layers)).train().to(device)
    x = torch.randn(args.batch_size, args.seq_len, args.n_embd).to(device)
    activation = x.numel() * x.element_size()
    if rank == 0:
        print(f"{args.layers} GPT blocks, activations {args.batch_size}x{args.seq_len}x{args.n_embd} "
              f"fp32 = {activation / 2**10:,.0f} KiB per block input, {world} ranks")
    results = {}
    for name, policy in policies(dist.group.WORLD).items():
        forward_backward(blocks, x, policy, args.seed)  # warm-up: first calls allocate lazily
        results[name] = forward_backward(blocks, x, policy, args.seed)
    reference = results["no checkpointing"]
    if rank == 0:
        header = f"{'mode':<40} {'saved KiB':>10} {'vs plain':>9} {'fwd+bwd s':>10}  grads == plain"
        print(header + "\n" + "-" * len(header))
        for name, (saved, elapsed, grads) in results.items():
            same = all(torch.equal(a, b) for a, b in zip(grads, reference[2]))
            print(f"{name:<40} {saved / 2**10:>10,.0f} {saved / reference[0]:>8.1%} "
                  f"{elapsed:>10.3f}  {same}")
        print(f"checkpoint keeps each block's input ({activation / 2**10:,.0f} KiB; the first is the "
              f"caller's x, not counted) and the output; partitioned keeps 1/{world} of each input.\n"
              "On a CPU-only machine activations already live in host memory: cpu_offload moves "
              "the kept shares off an accelerator, here it changes nothing.")
    dist.barrier()  # no rank tears its connections down while another still works
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
