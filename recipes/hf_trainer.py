"""Hugging Face ``Trainer`` on a model sharded by parts (ZeRO-3): ``parts.integrations.transformers.Trainer``.

    torchrun --standalone --nproc-per-node 2 recipes/hf_trainer.py
    torchrun --standalone --nproc-per-node 2 recipes/hf_trainer.py --compare-ddp --steps 4
    torchrun --standalone --nproc-per-node 2 recipes/hf_trainer.py --device cuda   # a GPU per rank

A tiny GPT-2 is built from a config (no download) under ``partitioned()`` and trained by
parts' drop-in ``Trainer`` with transformers' default knobs (fused AdamW, linear schedule,
clipping, a checkpoint every ``--save-steps``); that is all the parts-specific code there is:

    with partitioned():
        model = GPT2LMHeadModel(config)
    Trainer(model=model, args=TrainingArguments(...), train_dataset=data).train()

The default run trains, then resumes a second ``Trainer`` from the middle checkpoint and
prints whether its later losses equal the first run's. ``--compare-ddp`` first trains the
same model unsharded with transformers' own ``Trainer`` (DDP under torchrun), same seeds and
global batch, with clipping (``--max-grad-norm``) and without (0), and prints one line
``compare {json}`` (rank 0) with both runs' per-step losses and grad norms and the largest
difference of the final parameters (``tests/test_interop_trainer.py`` checks it). Needs
``pip install "parts[hf]"``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import devices

from parts.comm import broadcast_object
from parts.integrations.transformers import Trainer
from parts.partition import full_state_dict, partitioned


def parse_args() -> argparse.Namespace:
    """Command-line knobs (defaults: a few seconds of training on 2 CPU ranks)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--compare-ddp", action="store_true", help="also run transformers' DDP Trainer; print diffs")
    devices.add_device_flag(p)
    return p.parse_args()


def config() -> GPT2Config:
    """A tiny GPT-2 (2 layers, 32 wide, 97 tokens), dropout on."""
    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32,
                      bos_token_id=0, eos_token_id=0)


class Sequences(torch.utils.data.Dataset):
    """Arithmetic token sequences ``(a + k * t) % 97`` (learnable), from a fixed seed."""

    def __init__(self, rows: int, seq_len: int) -> None:
        g = torch.Generator().manual_seed(0)
        start, step = torch.randint(0, 97, (rows, 1), generator=g), torch.randint(1, 5, (rows, 1), generator=g)
        self.ids = (start + step * torch.arange(seq_len)) % 97

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_args(opts: argparse.Namespace, out: str, max_grad_norm: float) -> TrainingArguments:
    """The same arguments for the parts and the DDP run (save_strategy is Trainer's default, "steps")."""
    return TrainingArguments(output_dir=out, max_steps=opts.steps, per_device_train_batch_size=opts.batch_size,
                             learning_rate=opts.lr, weight_decay=0.1, max_grad_norm=max_grad_norm,
                             logging_steps=1, save_steps=opts.save_steps, report_to=[], seed=0,
                             use_cpu=opts.device_type == "cpu",
                             disable_tqdm=True, ddp_find_unused_parameters=False)


def train(opts: argparse.Namespace, out: str, max_grad_norm: float, sharded: bool,
          resume: str | None = None) -> tuple[Trainer, list]:
    """One Trainer run (parts' on a sharded model, or transformers' own); returns it and its logged steps."""
    torch.manual_seed(0)
    data = Sequences(opts.steps * opts.batch_size * dist.get_world_size(), opts.seq_len)
    args = training_args(opts, out, max_grad_norm)
    if sharded:
        with partitioned(device=torch.device(opts.device_type, torch.cuda.current_device())
                         if opts.device_type == "cuda" else None):
            model = GPT2LMHeadModel(config())
        trainer = Trainer(model=model, args=args, train_dataset=data)
    else:
        trainer = transformers.Trainer(model=GPT2LMHeadModel(config()), args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def final_state(trainer: Trainer, sharded: bool) -> dict:
    """The trained weights, full, on every rank."""
    state = full_state_dict(trainer.model, rank0_only=False) if sharded else trainer.model.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


def compare(opts: argparse.Namespace, out: str, max_grad_norm: float) -> dict:
    """The DDP Trainer run, then the parts run; losses, grad norms, parameter differences."""
    ref_trainer, ref_logs = train(opts, os.path.join(out, "ddp"), max_grad_norm, sharded=False)
    trainer, logs = train(opts, os.path.join(out, "parts"), max_grad_norm, sharded=True)
    ref, got = final_state(ref_trainer, False), final_state(trainer, True)
    trainer.save_model(os.path.join(out, "parts"))
    result = dict(max_grad_norm=max_grad_norm, ddp=ref_logs, parts=logs, keys_equal=sorted(ref) == sorted(got),
                  param_diff=max(float((got[k] - ref[k]).abs().max()) for k in ref))
    if dist.get_rank() == 0:  # what save_model wrote, read back by plain transformers
        saved = GPT2LMHeadModel.from_pretrained(os.path.join(out, "parts")).state_dict()
        result["saved_equal"] = all(torch.equal(saved[k], got[k].cpu()) for k in saved)
    return result


def train_and_resume(opts: argparse.Namespace, out: str) -> None:
    """Train with checkpoints, resume from the middle one, print both runs' later losses."""
    _, logs = train(opts, os.path.join(out, "run"), opts.max_grad_norm, sharded=True)
    middle = (opts.steps // 2) // opts.save_steps * opts.save_steps
    resumed = None
    if middle > 0:
        checkpoint = os.path.join(out, "run", f"checkpoint-{middle}")
        _, resumed = train(opts, os.path.join(out, "resumed"), opts.max_grad_norm, sharded=True, resume=checkpoint)
    if dist.get_rank() == 0:
        for step, (loss, norm) in enumerate(logs, 1):
            print(f"step {step:3d}  loss {loss:.4f}  grad norm {norm:.4f}", flush=True)
        if resumed is not None:
            print(f"resumed from checkpoint-{middle}: later losses equal: {resumed == logs}", flush=True)


def main() -> None:
    opts = parse_args()
    opts.device_type = devices.init(opts.device).type  # Trainer puts each rank on LOCAL_RANK's GPU too
    tmp = tempfile.mkdtemp(prefix="hf_trainer_") if dist.get_rank() == 0 else None
    out = broadcast_object(tmp)  # one directory: every rank names it
    if opts.compare_ddp:
        results = [compare(opts, out, clip) for clip in (opts.max_grad_norm, 0.0)]
        if dist.get_rank() == 0:
            print("compare " + json.dumps(results), flush=True)
    else:
        train_and_resume(opts, out)
    dist.barrier()
    if tmp is not None:
        shutil.rmtree(tmp)
    dist.barrier()  # no rank tears its connections down while another still works
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
