"""Host-memory snapshots (``parts.comm.Snapshots``) of a parts ``Trainer``'s run, and the restore
that continues it in the workers torchrun's agent restarts.

Every ``snapshots.every`` optimizer steps, after Trainer's own logging, evaluation and
checkpoint of that step, a snapshot holds each rank's shards of the weights and optimizer
state, the scheduler's state, Trainer's ``TrainerState`` (global step, epoch, log history,
stateful callbacks) and, as the rank's own value, the RNG states Trainer's checkpoints hold
(Python, numpy, torch, accelerator). ``train()`` first restores the newest snapshot of the job,
if there is one: the weights and the optimizer state (created early for it) at once, the rest
through Trainer's own resume path, fed from memory: its ``trainer_state.json`` is written into
a small folder under the snapshots' root (host memory), and the scheduler and RNG states come
from the snapshot where Trainer would read its checkpoint's files. Trainer then skips the
batches already trained in the epoch and puts the RNG states back where its own resume does,
so the run continues with the same data order and random draws.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any, Optional

import torch

from parts.comm import Restored, Snapshots
from parts.integrations.snapshot_values import from_bytes, rng_states, set_rng_states, to_bytes
from parts.partition import (load_sharded_optimizer_state_dict, load_sharded_state_dict,
                             sharded_optimizer_state_dict, sharded_state_dict)

TRAINER_STATE = "trainer_state.json"  # what Trainer's resume reads from a checkpoint folder


def trainer_state_text(trainer: Any) -> str:
    """``TrainerState`` as Trainer's checkpoint writes it (its stateful callbacks' states updated)."""
    state = dataclasses.asdict(trainer.state)
    callbacks = state.get("stateful_callbacks") or {}
    for callback in list(trainer.callback_handler.callbacks) + [trainer.control]:
        name, export = type(callback).__name__, getattr(callback, "state", None)
        if name in callbacks and callable(export):
            held = callbacks[name]
            callbacks[name] = held + [export()] if isinstance(held, list) else export()
    return json.dumps(state, indent=2, sort_keys=True) + "\n"


class TrainerSnapshots:
    """A ``Trainer``'s side of ``Snapshots``: what a snapshot holds, the restore, the resume folder."""

    def __init__(self, snapshots: Snapshots) -> None:
        if not isinstance(snapshots, Snapshots):
            raise TypeError(f"parts Trainer: snapshots= takes a parts.comm.Snapshots, got {type(snapshots).__name__}")
        self.snapshots = snapshots
        self.restored: Optional[Restored] = None
        self.folder: Optional[str] = None
        self._scheduler: Optional[bytes] = None
        self._groups: Optional[bytes] = None
        self._rng: Optional[dict] = None

    def state(self, trainer: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """What a snapshot holds beside the RNG states (every rank's shards; replicated values, the
        optimizer's param groups among them, as bytes: the scheduler adds keys to them)."""
        optim = sharded_optimizer_state_dict(trainer.model, optimizer)
        return {"model": sharded_state_dict(trainer.model),
                "optimizer": {"state": optim["state"], "param_groups": to_bytes(optim["param_groups"])},
                "scheduler": to_bytes(trainer.lr_scheduler.state_dict() if trainer.lr_scheduler else None),
                "trainer_state": trainer_state_text(trainer)}

    def save_if_due(self, trainer: Any, optimizer: torch.optim.Optimizer) -> None:
        """Snapshot the run at its global step if that step is due."""
        step = trainer.state.global_step
        if step > 0 and self.snapshots.due(step):
            self.snapshots.save(self.state(trainer, optimizer), step, local={"rng": rng_states()})

    def restore(self, trainer: Any, optimizer: torch.optim.Optimizer) -> Optional[str]:
        """Load the newest snapshot of the job into the model and ``optimizer``'s state; the folder
        Trainer resumes from (its ``trainer_state.json``), or None where there is no snapshot
        (``optimizer`` is then as it was: the state made to receive a snapshot is dropped).
        The process's RNG states are left as they were: Trainer puts them back where it resumes."""
        stateless, before = not any(optimizer.state.values()), rng_states()
        state = self.state(trainer, optimizer)
        groups = sharded_optimizer_state_dict(trainer.model, optimizer)["param_groups"]
        restored = self.snapshots.restore(state)
        set_rng_states(before)
        if restored is None:
            if stateless:
                optimizer.state.clear()
            return None
        load_sharded_state_dict(trainer.model, state["model"])
        load_sharded_optimizer_state_dict(trainer.model, optimizer,
                                          {"state": state["optimizer"]["state"], "param_groups": groups})
        self.restored, self._groups, self._scheduler = restored, state["optimizer"]["param_groups"], state["scheduler"]
        self._rng = (restored.local or {}).get("rng")
        self.folder = tempfile.mkdtemp(prefix="parts-trainer-resume-", dir=self.snapshots.root)
        with open(os.path.join(self.folder, TRAINER_STATE), "w", encoding="utf-8") as f:
            f.write(state["trainer_state"])
        return self.folder

    def resumes_from(self, checkpoint: Optional[str]) -> bool:
        """True when ``checkpoint`` is the folder ``restore`` made."""
        return checkpoint is not None and self.folder is not None and checkpoint == self.folder

    def load_groups_and_scheduler(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        """The snapshot's param groups (learning rates) into ``optimizer`` and its scheduler state into
        ``scheduler``, once Trainer made the scheduler (as its resume loads them: after it)."""
        for group, saved in zip(optimizer.param_groups, from_bytes(self._groups) or []):
            group.update({k: v for k, v in saved.items() if k != "params"})
        saved = from_bytes(self._scheduler)
        if saved is not None and scheduler is not None:
            scheduler.load_state_dict(saved)

    def load_rng(self) -> None:
        """The snapshot's RNG states, where the world is the one that saved it (as Trainer's resume does)."""
        if self._rng is not None:
            set_rng_states(self._rng)

    def end(self, finished: bool) -> None:
        """Remove the resume folder; after a finished run, the job's snapshots too (``Snapshots.close``)."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
        if finished:
            self.snapshots.close()
