"""Train the tensor-parallel GPT on a 2-D grid: ZeRO-3 over data parallel x tensor parallel.

    torchrun --standalone --nproc-per-node 4 recipes/train_gpt_2d.py            # 2 dp x 2 tp, bf16
    torchrun --standalone --nproc-per-node 4 recipes/train_gpt_2d.py --fp32     # fp32 params
    torchrun --standalone --nproc-per-node 8 recipes/train_gpt_2d.py --device cuda --tp 4   # a GPU per rank

Each tp group holds one copy of the model split by heads and MLP columns (gpt_tp_model.py);
each weight piece is sharded again over the dp group (``partitioned(group=dp_group)``) and
fetched per module by the coordinator. Block inputs are the same on every rank of a tp group,
so each checkpoint keeps only a 1/tp share of them (``CheckpointPolicy(partition_group=tp)``).
Grads are clipped by their norm over the whole grid, each element counted once.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import torch.distributed as dist

import devices
from chardata import VOCAB_SIZE, batch, load_splits
from gpt_model import GPTConfig
from gpt_tp_model import TPGPT
from parts.checkpoint import CheckpointPolicy, ContiguousBuffers, checkpoint, seed_model_parallel
from parts.optim import BF16Optimizer
from parts.parallel import ParallelGrid, tp_full_state_dict, tp_split
from parts.partition import attach, full_state_dict, partitioned, register_external_parameter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (defaults run in well under a minute on 4 CPU ranks)."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (dp = world / tp)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=8, help="global batch, split over dp")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0, help="max grad norm over the grid (0: off)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--fp32", action="store_true", help="fp32 params instead of bf16")
    ap.add_argument("--no-checkpoint", dest="checkpoint", action="store_false")
    ap.add_argument("--no-partition-activations", dest="partition", action="store_false")
    ap.add_argument("--cpu-offload", action="store_true", help="keep saved activations on the CPU")
    ap.add_argument("--contiguous-buffers", action="store_true")
    ap.add_argument("--check-replicated", action="store_true", help="debug: verify the replicas")
    ap.add_argument("--data", default=None, help="a text file (default: Python stdlib sources)")
    devices.add_device_flag(ap)
    return ap.parse_args(argv)


def make_optimizer(params, args: argparse.Namespace) -> torch.optim.Optimizer:
    """The wrapped optimizer (also used by the non-parallel reference in the tests)."""
    return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)


def config_of(args: argparse.Namespace) -> GPTConfig:
    """The model shape the options describe."""
    return GPTConfig(vocab_size=VOCAB_SIZE, block_size=args.seq_len, n_layer=args.n_layer,
                     n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout)


def policy_of(args: argparse.Namespace, grid: ParallelGrid, tracker) -> CheckpointPolicy:
    """How each block keeps its input until backward."""
    return CheckpointPolicy(partition_group=grid.tp_group if args.partition else None,
                            cpu_offload=args.cpu_offload, rng_tracker=tracker,
                            buffers=ContiguousBuffers(args.n_layer) if args.contiguous_buffers else None,
                            check_replicated=args.check_replicated and args.partition)


def build(args: argparse.Namespace, grid: ParallelGrid):
    """The TP GPT sharded over dp and hooked by the coordinator, its optimizer and checkpoint policy."""
    torch.manual_seed(args.seed)  # the default stream: the same on every rank (dropout outside tp)
    tracker = seed_model_parallel(args.seed, grid.tp_group)  # per tp rank (dropout inside tp)
    policy = policy_of(args, grid, tracker)
    ckpt = partial(checkpoint, policy=policy) if args.checkpoint else None
    device = devices.pick(args.device)
    with partitioned(group=grid.dp_group, dtype=torch.float32 if args.fp32 else torch.bfloat16, device=device):
        model = TPGPT(config_of(args), grid.tp_group, tracker=tracker, seed=args.seed,
                      checkpoint_fn=ckpt)
    attach(model, group=grid.dp_group)
    register_external_parameter(model, model.wte.weight)  # the tied head runs in the root's forward
    # clip by the norm over the whole grid: dp partitions summed over dp, then over tp; a param
    # that is not tp-split has the same grad on every tp rank, so only tp rank 0 counts it
    optimizer = BF16Optimizer(make_optimizer(model.parameters(), args), group=grid.dp_group,
                              clip_grad=args.clip, norm_groups=(grid.tp_group,),
                              replicated=lambda p: tp_split(p) is None, allow_fp32=args.fp32)
    return model, optimizer, policy


def local_batch(tokens: torch.Tensor, args: argparse.Namespace, step: int, grid: ParallelGrid):
    """This dp rank's slice of the global batch of ``step`` (the same on every rank of a tp group)."""
    inputs, targets = batch(tokens, args.batch_size, args.seq_len,
                            torch.Generator().manual_seed(args.seed * 100_003 + step))
    per = args.batch_size // grid.dp_size
    rows = slice(grid.dp_rank * per, (grid.dp_rank + 1) * per)
    return devices.to(devices.pick(args.device), inputs[rows], targets[rows])


def train_step(model, optimizer, policy, inputs, targets):
    """Forward, backward, step (which clips by the grid-wide norm); the local loss and that norm."""
    if policy.buffers is not None:
        policy.buffers.reset()
    loss = model(inputs, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach(), optimizer.last_grad_norm


def train(args: argparse.Namespace, grid: ParallelGrid, tokens: torch.Tensor, log=None) -> dict:
    """Run ``args.steps`` steps; returns the dp-mean losses, grad norms and the full final params."""
    if args.batch_size % grid.dp_size:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by dp size {grid.dp_size}")
    model, optimizer, policy = build(args, grid)
    losses, norms = [], []
    for step in range(args.steps):
        start = time.perf_counter()
        loss, norm = train_step(model, optimizer, policy, *local_batch(tokens, args, step, grid))
        dist.all_reduce(loss, group=grid.dp_group)
        losses.append(loss.item() / grid.dp_size)
        norms.append(norm)
        if log is not None:
            log(f"step {step:3d}  loss {losses[-1]:.4f}  grad norm {norms[-1]:.3f}  "
                f"{time.perf_counter() - start:.2f} s")
    params = tp_full_state_dict(model, full_state_dict(model, rank0_only=False), grid.tp_group)
    return dict(losses=losses, norms=norms, params=params)


def main(argv: list[str] | None = None) -> None:
    """torchrun entry point."""
    args = parse_args(argv)
    devices.init(args.device)
    grid = ParallelGrid(args.tp)
    log = print if dist.get_rank() == 0 else None
    if log:
        log(f"grid: {grid.dp_size} dp x {grid.tp_size} tp, {'fp32' if args.fp32 else 'bf16'} params")
    train_tokens, _ = load_splits(args.data)
    start = time.perf_counter()
    out = train(args, grid, train_tokens, log)
    if log:
        log(f"{args.steps} steps in {time.perf_counter() - start:.1f} s, final loss {out['losses'][-1]:.4f}")
    dist.barrier()  # no rank tears its connections down while another still works
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
