"""Fine-tune a model from elsewhere: plain state_dict in, ZeRO-3 training, plain state_dict out.

    torchrun --standalone --nproc-per-node 2 recipes/finetune_from_state_dict.py
    torchrun --standalone --nproc-per-node 2 recipes/finetune_from_state_dict.py \
        --weights gpt.pt --out tuned.pt --dtype bf16
    torchrun --standalone --nproc-per-node 8 recipes/finetune_from_state_dict.py --device cuda

``--weights`` is an ordinary ``torch.save(model.state_dict())`` file of the recipe GPT; without
it the recipe first writes one (a freshly initialised GPT stands in for a downloaded model).
Rank 0 reads the file; ``load_full_state_dict`` broadcasts it into a model built sharded
(``partitioned()``), so no rank but 0 ever holds the whole dict. ``attach`` fetches weights
per module; fp32 shards train with a plain ``torch.optim.AdamW(shards(model))`` (``--dtype
bf16``: ``BF16Optimizer``). ``full_state_dict`` writes a plain state_dict back out with
``torch.save``, and the recipe checks that a plain, unsharded GPT loads it and computes the
same validation loss as the sharded model.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist

import devices
from chardata import VOCAB_SIZE, batch, load_splits
from gpt_model import GPT, GPTConfig
from parts.optim import BF16Optimizer
from parts.partition import full_state_dict, load_full_state_dict, partitioned, shards

try:
    from parts.partition import attach, register_external_parameter
except ImportError:  # until the package re-exports the coordinator
    from parts.partition.coordinator import attach, register_external_parameter

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args() -> argparse.Namespace:
    """Command-line knobs (defaults run in well under a minute on 2 CPU ranks)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workdir = os.path.join(tempfile.gettempdir(), "parts-finetune")
    ap.add_argument("--weights", default=None, help="plain state_dict to start from (default: write one)")
    ap.add_argument("--out", default=os.path.join(workdir, "finetuned.pt"), help="where to write the result")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--data", default=None, help="a text file (default: Python stdlib sources)")
    devices.add_device_flag(ap)
    return ap.parse_args()


def pretrained_file(args: argparse.Namespace, config: GPTConfig) -> str:
    """``--weights``, or a plain GPT state_dict written now on rank 0 (the 'downloaded' model)."""
    if args.weights:
        return args.weights
    path = os.path.join(os.path.dirname(os.path.abspath(args.out)), "pretrained.pt")
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.manual_seed(args.seed)
        torch.save(GPT(config).state_dict(), path)
    dist.barrier()
    return path


@torch.no_grad()
def val_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Loss on a fixed validation batch (the same on every rank)."""
    return model.eval()(inputs, targets).item()


def plain_val_loss(path: str, config: GPTConfig, dtype: str, inputs: torch.Tensor,
                   targets: torch.Tensor) -> float:
    """Load a state_dict file into a plain, unsharded GPT (strict) and return its validation loss
    (computed on the device of ``inputs``)."""
    plain = GPT(config)
    plain.load_state_dict(torch.load(path, weights_only=True))  # strict: every key, every shape
    return val_loss(plain.to(inputs.device, DTYPES[dtype]), inputs, targets)


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """Plain AdamW over the fp32 shards, or BF16Optimizer (fp32 master) over bf16 ones."""
    if args.dtype == "fp32":
        return torch.optim.AdamW(shards(model), lr=args.lr, weight_decay=0.0)
    return BF16Optimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0))


def main() -> None:
    args = parse_args()
    device = devices.init(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = GPTConfig(vocab_size=VOCAB_SIZE, block_size=args.seq_len, n_layer=args.n_layer,
                       n_head=4, n_embd=args.n_embd)
    weights = pretrained_file(args, config)
    with partitioned(dtype=DTYPES[args.dtype], device=device):
        model = GPT(config)
    state = torch.load(weights, weights_only=True) if rank == 0 else {}
    load_full_state_dict(model, state)  # rank 0's dict, broadcast and sliced into shards
    del state
    attach(model)
    register_external_parameter(model, model.wte.weight)  # the tied head runs in the root's forward
    optimizer = make_optimizer(model, args)
    train, val = load_splits(args.data)
    val_inputs, val_targets = devices.to(device, *batch(val, 16, args.seq_len, torch.Generator().manual_seed(0)))
    before = val_loss(model, val_inputs, val_targets)
    if rank == 0:
        print(f"loaded {weights} into a {args.dtype} GPT sharded over {world} ranks; "
              f"validation loss {before:.4f}")
    generator = torch.Generator().manual_seed(args.seed + rank)
    for step in range(1, args.steps + 1):
        model.train()
        inputs, targets = devices.to(device, *batch(train, args.batch_size, args.seq_len, generator))
        loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == 1):
            print(f"step {step:3d}  loss {loss.item():.4f} (rank 0's batch)", flush=True)
    after = val_loss(model, val_inputs, val_targets)
    state = full_state_dict(model)  # plain keys and shapes, on rank 0 ({} elsewhere)
    if rank == 0:
        torch.save({k: v.cpu() for k, v in state.items()}, args.out)  # a file any machine loads
        reloaded = plain_val_loss(args.out, config, args.dtype, val_inputs, val_targets)
        original = plain_val_loss(weights, config, args.dtype, val_inputs, val_targets)
        print(f"validation loss {before:.4f} -> {after:.4f} after {args.steps} steps "
              f"(plain GPT from {os.path.basename(weights)}: {original:.4f}, equal: {original == before})")
        print(f"wrote {args.out}: {len(state)} tensors, a plain state_dict")
        print(f"plain GPT loads it (strict) and gets validation loss {reloaded:.4f} "
              f"(sharded model: {after:.4f}, equal: {reloaded == after})")
    dist.barrier()  # no rank tears its connections down while another still works
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
