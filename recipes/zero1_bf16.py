"""Data parallelism without DDP: BF16Optimizer alone over a replicated bf16 GPT (ZeRO-1).

    torchrun --standalone --nproc-per-node 2 recipes/zero1_bf16.py
    torchrun --standalone --nproc-per-node 2 recipes/zero1_bf16.py --steps 50 --clip 0.5
    torchrun --standalone --nproc-per-node 8 recipes/zero1_bf16.py --device cuda   # a GPU per rank

Every rank holds the whole bf16 model and sees its own batches. ``BF16Optimizer`` does what
DDP and a mixed-precision optimizer would do together: backward accumulates each grad into
an fp32 flat buffer; ``step()`` reduce-scatters it (mean over ranks), clips by the global
norm, steps AdamW on this rank's fp32 master partition only, writes bf16 back and
all-gathers, so the replicas stay bitwise identical. Nothing is partitioned but the
optimizer state. At the end the model-state bytes per rank are compared with the formula.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import devices
from chardata import VOCAB_SIZE, batch, load_splits
from gpt_model import GPT, GPTConfig
from parts.comm import all_gather_objects
from parts.observe import storage_bytes
from parts.optim import BF16Optimizer


def parse_args() -> argparse.Namespace:
    """Command-line knobs (defaults run in well under a minute on 2 CPU ranks)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0, help="max global grad norm (0: off)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--data", default=None, help="a text file (default: Python stdlib sources)")
    devices.add_device_flag(ap)
    return ap.parse_args()


def model_state_bytes(model: torch.nn.Module, optimizer: BF16Optimizer) -> dict[str, int]:
    """This rank's model-state bytes by component (each storage counted once)."""
    flats = [fg for fg in optimizer.flat_groups if fg is not None]
    return {
        "bf16 params (replicated)": storage_bytes(model),
        "fp32 grad accumulation buffer (replicated)": storage_bytes([fg.grad for fg in flats]),
        "fp32 grad partition": storage_bytes([fg.part_grad for fg in flats]),
        "fp32 master partition": storage_bytes([fg.master for fg in flats]),
        "AdamW m + v (+ step)": storage_bytes(list(optimizer.state.values())),
    }


def formula(numel: int, world: int) -> dict[str, float]:
    """The same components from Ψ and N (mixed-precision Adam, optimizer state sharded)."""
    return {"bf16 params (replicated)": 2 * numel,
            "fp32 grad accumulation buffer (replicated)": 4 * numel,
            "fp32 grad partition": 4 * numel / world,
            "fp32 master partition": 4 * numel / world,
            "AdamW m + v (+ step)": 8 * numel / world}


def replicas_identical(model: torch.nn.Module) -> bool:
    """True if every rank holds bitwise the same parameters (checked by gathering them all)."""
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


def main() -> None:
    args = parse_args()
    device = devices.init(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # same seed everywhere: every replica starts identical
    config = GPTConfig(vocab_size=VOCAB_SIZE, block_size=args.seq_len, n_layer=args.n_layer,
                       n_head=4, n_embd=args.n_embd)
    model = GPT(config).to(device, torch.bfloat16)
    optimizer = BF16Optimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1),
                              clip_grad=args.clip, named_parameters=model.named_parameters())
    train, _ = load_splits(args.data)
    generator = torch.Generator().manual_seed(args.seed + rank)  # each rank its own batches
    numel = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"GPT of {numel:,} bf16 parameters on {world} ranks, "
              f"{args.batch_size}x{args.seq_len} tokens per rank per step")
    for step in range(1, args.steps + 1):
        inputs, targets = devices.to(device, *batch(train, args.batch_size, args.seq_len, generator))
        loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = loss.detach().float()
        dist.all_reduce(mean_loss)
        if rank == 0:
            print(f"step {step:3d}  loss {mean_loss.item() / world:.4f}  "
                  f"grad norm {optimizer.last_grad_norm:.3f}", flush=True)
    identical = replicas_identical(model)
    measured = model_state_bytes(model, optimizer)
    everyone = all_gather_objects(measured)
    if rank == 0:
        print(f"replicas bitwise identical after {args.steps} steps: {identical}")
        expected = formula(numel, world)
        header = f"{'model state per rank':<44} {'formula':>12} " + " ".join(
            f"{f'rank {r}':>12}" for r in range(world))
        print(header + "\n" + "-" * len(header))
        for key in [*expected, "total"]:
            want = sum(expected.values()) if key == "total" else expected[key]
            got = [sum(m.values()) if key == "total" else m[key] for m in everyone]
            print(f"{key:<44} {want:>12,.0f} " + " ".join(f"{g:>12,}" for g in got))
        print(f"formula: 2Ψ + 4Ψ + (4 + K)Ψ/N with K = 12 (fp32 master + m + v), Ψ = {numel:,}, "
              f"N = {world};\nthe 4Ψ fp32 grad buffer keeps micro-batch accumulation in fp32; "
              "measured bytes include partition padding")
    dist.barrier()  # no rank tears its connections down while another still works
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
