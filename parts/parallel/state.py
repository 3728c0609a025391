"""Full (un-split) state dicts of a tensor-parallel model, and the tp slice of a full one."""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn as nn

from parts.comm import GroupArg

from . import _collectives as C
from .layers import shard_tensor, tp_split, unshard_tensor


def tp_full_state_dict(module: nn.Module, local: Mapping[str, torch.Tensor],
                       group: GroupArg) -> dict[str, torch.Tensor]:
    """``local`` (this rank's tp pieces, by ``module``'s parameter names) made full over ``group``.

    A collective over ``group``: every tp rank passes its own ``local`` (e.g. the output of
    ``parts.partition.full_state_dict(module, rank0_only=False)``) and gets the full tensors.
    Entries that are not tp pieces pass through unchanged.
    """
    splits = {name: tp_split(p) for name, p in module.named_parameters()}
    out = {}
    for name, value in local.items():
        split = splits.get(name)
        out[name] = unshard_tensor(C.all_gather_tp(value, group), *split) if split else value
    return out


def tp_slice_state_dict(module: nn.Module, full: Mapping[str, torch.Tensor],
                        group: GroupArg) -> dict[str, torch.Tensor]:
    """This tp rank's pieces of a full state dict (inverse of :func:`tp_full_state_dict`)."""
    splits = {name: tp_split(p) for name, p in module.named_parameters()}
    size, rank = C.group_size(group), C.group_rank(group)
    out = {}
    for name, value in full.items():
        split = splits.get(name)
        out[name] = shard_tensor(value, split[0], size, rank, split[1]) if split else value
    return out
