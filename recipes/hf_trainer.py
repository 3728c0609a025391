"""Hugging Face ``Trainer``, unmodified, on a model sharded by parts (ZeRO-3), at world 2.

    torchrun --standalone --nproc-per-node 2 recipes/hf_trainer.py
    torchrun --standalone --nproc-per-node 2 recipes/hf_trainer.py --compare-ddp --steps 4

A tiny GPT-2 is built from a config (no download) under ``partitioned()``, ``attach``ed, and
trained by ``PartsTrainer``: ``transformers.Trainer`` with four small overrides, below.
``--compare-ddp`` first trains the same model unsharded with the plain ``Trainer`` (which
wraps it in DDP under torchrun), same seeds and global batch, twice: with gradient clipping
(``--max-grad-norm``) and without (0), then the parts run of each, and prints one line
``compare {json}`` (rank 0) with both runs' per-step losses and grad norms and the largest
difference of the final parameters. ``tests/test_interop_trainer.py`` checks it. Needs
``pip install "parts[hf]"``.

What ``Trainer`` does, and how parts meets each:
- ``model.to(device)``: a no-op on the device the shards live on (parts' ``_apply``).
- ``model.zero_grad()`` (before training and after every step): clears the grad shards.
- its optimizer, built by ``create_optimizer`` over ``model.parameters()`` (decay and
  no-decay groups, ``optim`` such as the default fused AdamW): ``use_shards`` swaps each
  sharded parameter for its shard, every group setting kept; the scheduler is Trainer's own.
  Fused kernels bump no version counter: parts counts optimizer steps on the shards, so the
  parameters kept gathered between steps are refreshed.
- gradient clipping and the logged ``grad_norm`` (``accelerator.clip_grad_norm_(model.parameters())``,
  which reads ``p.grad`` and raises for sharded parameters): ``_clip_grad_norm`` and
  ``_get_grad_norm`` use ``parts.partition.clip_grad_norm_`` / ``grad_norm``, the global norm.
- DDP: under torchrun accelerate wraps the model in ``DistributedDataParallel`` (which would
  broadcast and all-reduce released parameters); the model is marked
  ``_is_accelerate_prepared`` so accelerate leaves it alone (nor does it wrap ``forward`` in
  autocast then: use ``attach(..., mixed_precision=...)``). The data is still split by rank.
- ``save_model``: ``full_state_dict`` (a collective), written by ``save_pretrained`` on rank 0.
  Trainer checkpoints (``save_strategy``) would save rank 0's shards of the optimizer only:
  refused; checkpoint with ``parts.partition.sharded_state_dict`` (DCP) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from parts.comm import broadcast_object
from parts.partition import attach, clip_grad_norm_, full_state_dict, partitioned, use_shards
from parts.partition import grad_norm as global_grad_norm


class PartsTrainer(Trainer):
    """``transformers.Trainer`` for a model built under ``partitioned()`` and ``attach``ed."""

    def __init__(self, model: torch.nn.Module, args: TrainingArguments, **kwargs) -> None:
        if args.save_strategy != "no":
            raise ValueError("PartsTrainer: Trainer checkpoints would hold rank 0's optimizer shards "
                             "only; pass save_strategy='no' and checkpoint with "
                             "parts.partition.sharded_state_dict / sharded_optimizer_state_dict")
        model._is_accelerate_prepared = True  # accelerate: no DDP around the sharded model
        super().__init__(model=model, args=args, **kwargs)

    def create_optimizer(self, model=None):
        """Trainer's optimizer (its groups, its ``optim``), stepping the shards."""
        return use_shards(super().create_optimizer(model))

    def _clip_grad_norm(self, model):
        """Clip by the global norm over every rank's grad shards; return that norm."""
        return clip_grad_norm_(model, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        """The logged grad norm: the clipped one, else the global norm (no clipping)."""
        return float(grad_norm if grad_norm is not None else global_grad_norm(model))

    def save_model(self, output_dir=None, _internal_call=False):
        """``save_pretrained`` of the consolidated weights, on rank 0."""
        state = full_state_dict(self.model)
        if self.args.should_save:
            self.model.save_pretrained(output_dir or self.args.output_dir, state_dict=state)


def parse_args() -> argparse.Namespace:
    """Command-line knobs (defaults: a few seconds of training on 2 CPU ranks)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--compare-ddp", action="store_true", help="also run the plain DDP Trainer; print diffs")
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
    """The same arguments for the parts and the DDP run."""
    return TrainingArguments(output_dir=out, max_steps=opts.steps, per_device_train_batch_size=opts.batch_size,
                             learning_rate=opts.lr, weight_decay=0.1, max_grad_norm=max_grad_norm,
                             logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True,
                             disable_tqdm=True, ddp_find_unused_parameters=False)


def train(opts: argparse.Namespace, out: str, max_grad_norm: float, sharded: bool) -> tuple[dict, list]:
    """One Trainer run; returns the final full state dict (every rank) and the logged steps."""
    torch.manual_seed(0)
    data = Sequences(opts.steps * opts.batch_size * dist.get_world_size(), opts.seq_len)
    args = training_args(opts, out, max_grad_norm)
    if sharded:
        with partitioned():
            model = GPT2LMHeadModel(config())
        attach(model)
        trainer = PartsTrainer(model=model, args=args, train_dataset=data)
    else:
        model = GPT2LMHeadModel(config())
        trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    state = full_state_dict(model, rank0_only=False) if sharded else model.state_dict()
    logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    if sharded:
        trainer.save_model(out)
    return {k: v.detach().clone() for k, v in state.items()}, logs


def compare(opts: argparse.Namespace, out: str, max_grad_norm: float) -> dict:
    """The DDP Trainer run, then the parts run; losses, grad norms, parameter differences."""
    ref, ref_logs = train(opts, os.path.join(out, "ddp"), max_grad_norm, sharded=False)
    got, logs = train(opts, os.path.join(out, "parts"), max_grad_norm, sharded=True)
    result = dict(max_grad_norm=max_grad_norm, ddp=ref_logs, parts=logs,
                  keys_equal=sorted(ref) == sorted(got),
                  param_diff=max(float((got[k] - ref[k]).abs().max()) for k in ref))
    if dist.get_rank() == 0:  # what save_model wrote, read back by plain transformers
        saved = GPT2LMHeadModel.from_pretrained(os.path.join(out, "parts")).state_dict()
        result["saved_equal"] = all(torch.equal(saved[k], got[k]) for k in saved)
    return result


def main() -> None:
    opts = parse_args()
    dist.init_process_group("gloo")
    tmp = tempfile.mkdtemp(prefix="hf_trainer_") if dist.get_rank() == 0 else None
    out = broadcast_object(tmp)  # one directory: rank 0 saves, every rank names it
    if opts.compare_ddp:
        results = [compare(opts, out, clip) for clip in (opts.max_grad_norm, 0.0)]
        if dist.get_rank() == 0:
            print("compare " + json.dumps(results), flush=True)
    else:
        _, logs = train(opts, out, opts.max_grad_norm, sharded=True)
        if dist.get_rank() == 0:
            for step, (loss, norm) in enumerate(logs, 1):
                print(f"step {step:3d}  loss {loss:.4f}  grad norm {norm:.4f}", flush=True)
    dist.barrier()
    if tmp is not None:
        shutil.rmtree(tmp)
    dist.barrier()  # no rank tears its connections down while another still works
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
