"""Sharded checkpoints of a parts model and its optimizer, as the integrations write them.

Each is one DCP directory (``parts.comm.dcp``): every rank writes its own shards, keys are
the plain FQNs of ``model.state_dict()`` (the optimizer's as torch's
``get_optimizer_state_dict`` gives them for FSDP2), global shapes, so a directory loads at
any world size (and into FSDP2). No rank gathers the full model or optimizer.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from parts.partition import (load_sharded_optimizer_state_dict, load_sharded_state_dict,
                             sharded_optimizer_state_dict, sharded_state_dict)


def _dcp() -> Any:
    """``parts.comm.dcp``, imported on first use (torch.distributed.checkpoint takes seconds)."""
    from parts.comm import dcp
    return dcp


def _existing(path: str, what: str) -> str:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"parts: no {what} checkpoint at {path} (a DCP directory written by "
                                f"parts.integrations)")
    return path


def save_sharded_model(model: nn.Module, path: str) -> None:
    """Every rank writes its shards of ``model`` into the DCP directory ``path`` (a collective)."""
    _dcp().save(sharded_state_dict(model), checkpoint_id=path)


def load_sharded_model(model: nn.Module, path: str) -> None:
    """Load the DCP directory ``path`` (written at any world size) into ``model``'s shards."""
    state = sharded_state_dict(model)
    _dcp().load(state, checkpoint_id=_existing(path, "model"))
    load_sharded_state_dict(model, state)


def save_sharded_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Every rank writes its shard of the optimizer state of ``model`` into ``path`` (a collective)."""
    _dcp().save(sharded_optimizer_state_dict(model, optimizer), checkpoint_id=path)


def load_sharded_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Load the optimizer state in ``path`` (written at any world size) into this rank's shard of it."""
    state = sharded_optimizer_state_dict(model, optimizer)
    _dcp().load(state, checkpoint_id=_existing(path, "optimizer"))
    load_sharded_optimizer_state_dict(model, optimizer, state)
