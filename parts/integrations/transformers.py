"""``transformers.Trainer`` for a parts model: import ``Trainer`` from here instead of transformers.

    from parts.integrations.transformers import Trainer
    with partitioned():
        model = AutoModelForCausalLM.from_config(config)
    Trainer(model=model, args=TrainingArguments(output_dir=...), train_dataset=data).train()

With any ``TrainingArguments`` that parts can honour (the default ``save_strategy="steps"``
included), it differs from transformers' ``Trainer`` only where a sharded model must:

- the model is attached (``parts.partition.attach``) unless it already is, with
  ``bf16=True`` as ``parts.partition.MixedPrecision`` (``fp16`` raises); its accelerator
  gets ``parts.integrations.accelerate.PartsAcceleratorMixin``, so it is never wrapped in DDP;
- with ``gradient_accumulation_steps`` > 1 every micro-batch but the last runs under
  ``parts.partition.no_sync`` (through the accelerator's ``no_sync``): a hybrid layout averages
  its grads across replicas once per step, overlapped with the last micro-batch's backward;
- the optimizer Trainer builds (its ``optim``, learning rate, weight-decay groups, scheduler)
  steps ``shards(model)``; gradient clipping and the logged ``grad_norm`` are the global norm
  over every rank's grad shards (``parts.partition.clip_grad_norm_`` / ``grad_norm``);
- a checkpoint (``checkpoint-N/``, every ``save_steps``) holds the weights and every rank's
  optimizer shard as DCP checkpoints (``parts_model/``, ``parts_optimizer/``: FQN keys, global
  shapes, loadable at any world size and by FSDP2), beside Trainer's own scheduler, RNG and
  trainer state and ``config.json`` (and a peft model's ``adapter_config.json``);
  ``resume_from_checkpoint`` loads them at any world size. No rank gathers the full model for
  a checkpoint (as with DeepSpeed ZeRO-3 checkpoints);
- ``save_model`` gathers the current full weights to rank 0 (``full_state_dict``) and writes
  them with ``save_pretrained`` (``model.safetensors``), readable by ``from_pretrained``.
- with ``snapshots=parts.comm.Snapshots(K)``, every K steps the run's state goes into host
  memory (``parts.integrations.trainer_snapshots``), and ``train()`` in the workers torchrun's
  agent restarts (the same command line) continues from the newest snapshot, mid-epoch, bitwise
  as if it had not stopped; a finished ``train()`` removes the job's snapshots.

``Seq2SeqTrainer`` is the same over ``transformers.Seq2SeqTrainer``: ``predict_with_generate``
evaluates and predicts inside ``parts.partition.generating(model)`` (the model gathered once
when it fits, else streamed) and generates with ``synced_gpus=True`` at world > 1, so a rank
whose sequences ended keeps joining the others' gathers (in code of your own, use both too).
Not honoured, and refused where accelerate sees them: ``fp16`` (use ``bf16``), ``fsdp`` /
``deepspeed`` (the model is sharded already), ``model_init`` (pass a sharded ``model``).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Optional

import torch
import transformers
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings

from parts.comm import Snapshots
from parts.integrations.accelerate import adopt, attach_for, attach_with, is_parts_model
from parts.integrations.checkpoint import (load_sharded_model, load_sharded_optimizer, save_sharded_model,
                                           save_sharded_optimizer)
from parts.integrations.trainer_snapshots import TrainerSnapshots
from parts.partition import clip_grad_norm_, full_state_dict, generating, is_partitioned, use_shards
from parts.partition import grad_norm as global_grad_norm

__all__ = ["Trainer", "Seq2SeqTrainer", "PartsTrainerMixin", "MODEL_DIR", "OPTIMIZER_DIR"]

MODEL_DIR = "parts_model"  # a checkpoint's DCP directory of the model's weights
OPTIMIZER_DIR = "parts_optimizer"  # ... and of the optimizer's state, every rank's shard


def _torch_optimizer(optimizer: Any) -> Any:
    """The optimizer under accelerate's wrapper (what ``sharded_optimizer_state_dict`` reads)."""
    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


class PartsTrainerMixin:
    """What a ``transformers.Trainer`` needs to train a parts model; see the module docstring."""

    def __init__(self, model: Optional[nn.Module] = None, args: Any = None, *rest: Any,
                 snapshots: Optional[Snapshots] = None, **kwargs: Any) -> None:
        if not is_parts_model(model):
            raise TypeError(f"parts Trainer: model= takes a module with sharded parameters (built under "
                            f"parts.partition.partitioned() or sharded by partition_module), got "
                            f"{type(model).__name__}; for a plain model use transformers.Trainer")
        self._parts_checkpointing = False
        self._parts_snapshots = TrainerSnapshots(snapshots) if snapshots is not None else None
        args = args if args is not None else transformers.TrainingArguments(output_dir="tmp_trainer")
        # attached before Trainer moves the model to its device: the coordinator owns placement
        attach_with(model, args.mixed_precision)
        super().__init__(model, args, *rest, **kwargs)
        attach_for(self.accelerator, self.model)  # the accelerator agrees (ACCELERATE_MIXED_PRECISION)

    def train(self, resume_from_checkpoint: Any = None, *rest: Any, **kwargs: Any) -> Any:
        """Trainer's ``train``; with ``snapshots=``, from the job's newest snapshot where there is one
        (before ``resume_from_checkpoint``), and the job's snapshots removed once it finishes."""
        snaps = self._parts_snapshots
        if snaps is None:
            return super().train(resume_from_checkpoint, *rest, **kwargs)
        ours = self.optimizer is None
        folder = snaps.restore(self, _torch_optimizer(self.create_optimizer()))
        if folder is None and ours:
            self.optimizer = None  # built anew where Trainer builds it
        finished = False
        try:
            output = super().train(folder or resume_from_checkpoint, *rest, **kwargs)
            finished = True
            return output
        finally:
            snaps.end(finished)

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """Trainer's logging, evaluation and checkpoint of a step; then a snapshot where one is due."""
        super()._maybe_log_save_evaluate(*args, **kwargs)
        if self._parts_snapshots is not None:
            self._parts_snapshots.save_if_due(self, _torch_optimizer(self.optimizer))

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        """The RNG states of the checkpoint, or of the snapshot resumed from."""
        if self._parts_snapshots is not None and self._parts_snapshots.resumes_from(checkpoint):
            self._parts_snapshots.load_rng()
            return
        super()._load_rng_state(checkpoint)

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator, with parts' ``prepare_model`` (no DDP wrap) and ``clip_grad_norm_``."""
        super().create_accelerator_and_postprocess()
        adopt(self.accelerator)

    def create_optimizer(self, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
        """Trainer's optimizer (its ``optim``, groups and settings), stepping the shards."""
        optimizer = super().create_optimizer(model)
        inner = _torch_optimizer(optimizer)
        if any(is_partitioned(p) for group in inner.param_groups for p in group["params"]):
            use_shards(inner)  # a user's optimizer over the shards is kept as it is
        return optimizer

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """Clip by the global norm over every rank's grad shards (p.grad of a sharded param is empty)."""
        return clip_grad_norm_(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> float:
        """The logged norm: the clipped one, else the global norm (no clipping)."""
        return float(grad_norm if grad_norm is not None else global_grad_norm(self.model))

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        self._parts_checkpointing = True  # save_model writes the sharded weights, not full ones
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._parts_checkpointing = False

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The current full weights, gathered to rank 0 and written by ``save_pretrained`` there
        (a collective: every rank calls it, as Trainer does)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self._parts_checkpointing:
            self._save_sharded_weights(output_dir)
            return
        state = full_state_dict(self.model)  # a collective: every rank, before rank 0 writes
        self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_sharded_weights(self, output_dir: str) -> None:
        save_sharded_model(self.model, os.path.join(output_dir, MODEL_DIR))
        config = getattr(self.model, "config", None)
        if self.args.should_save and hasattr(config, "save_pretrained"):
            config.save_pretrained(output_dir)
        adapter = getattr(self.model, "peft_config", {}).get("default")
        if self.args.should_save and hasattr(adapter, "save_pretrained"):
            adapter.save_pretrained(output_dir)  # adapter_config.json: parts.export writes the adapter with it

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank's optimizer shard (DCP) and Trainer's scheduler file."""
        save_sharded_optimizer(self.model, _torch_optimizer(self.optimizer), os.path.join(output_dir, OPTIMIZER_DIR))
        if self.args.should_save:
            with warnings.catch_warnings(record=True) as caught:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            reissue_pt_warnings(caught)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
        """The checkpoint's sharded weights, at this world size (a snapshot's are restored already)."""
        if self._parts_snapshots is not None and self._parts_snapshots.resumes_from(resume_from_checkpoint):
            return
        load_sharded_model(model if model is not None else self.model,
                           os.path.join(resume_from_checkpoint, MODEL_DIR))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        """The checkpoint's optimizer state (resharded to this world size) and scheduler."""
        if checkpoint is None:
            return
        if self._parts_snapshots is not None and self._parts_snapshots.resumes_from(checkpoint):
            # the optimizer's state is restored already; its learning rates follow the scheduler's making
            self._parts_snapshots.load_groups_and_scheduler(_torch_optimizer(self.optimizer), self.lr_scheduler)
            return
        path = os.path.join(checkpoint, OPTIMIZER_DIR)
        if os.path.isdir(path):  # save_only_model checkpoints hold none
            load_sharded_optimizer(self.model, _torch_optimizer(self.optimizer), path)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            with warnings.catch_warnings(record=True) as caught:
                self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
            reissue_pt_warnings(caught)

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's sharded weights."""
        load_sharded_model(self.model, os.path.join(self.state.best_model_checkpoint, MODEL_DIR))


class Trainer(PartsTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` for a model sharded by ``parts.partition`` (drop-in)."""


class Seq2SeqTrainer(PartsTrainerMixin, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` (``predict_with_generate``) for a model sharded by ``parts.partition``."""

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Optional[list] = None,
                 metric_key_prefix: str = "eval", **gen_kwargs: Any) -> dict:
        """``Seq2SeqTrainer.evaluate``, generating with ``synced_gpus`` at world > 1."""
        gen_kwargs.setdefault("synced_gpus", self.args.world_size > 1)
        with self._generating():
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix, **gen_kwargs)

    def predict(self, test_dataset: Any, ignore_keys: Optional[list] = None, metric_key_prefix: str = "test",
                **gen_kwargs: Any) -> Any:
        """``Seq2SeqTrainer.predict``, generating with ``synced_gpus`` at world > 1: every rank runs a
        forward (and its gathers) until the sequences of all ranks are done."""
        gen_kwargs.setdefault("synced_gpus", self.args.world_size > 1)
        with self._generating():
            return super().predict(test_dataset, ignore_keys, metric_key_prefix, **gen_kwargs)

    def _generating(self) -> contextlib.AbstractContextManager:
        """``generating(model)`` with ``predict_with_generate``: no gather per decoding step."""
        if not getattr(self.args, "predict_with_generate", False):
            return contextlib.nullcontext()
        return generating(self.model)
