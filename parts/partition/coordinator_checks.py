"""Input checks of ``attach``: clear errors naming the parameter or rank, before any hook."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from parts.partition.param import is_partitioned, meta

__all__ = ["check_group", "check_sharded"]


def check_sharded(module: nn.Module, attached: Any) -> None:
    """An nn.Module, not yet attached (``attached``: module -> coordinator), all params sharded."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"attach: expected an nn.Module, got {type(module).__name__}")
    if module in attached:
        raise RuntimeError(f"attach: {type(module).__name__} already has a FetchCoordinator; "
                           "call its detach() first")
    for name, p in module.named_parameters():
        if not is_partitioned(p):
            raise ValueError(f"attach: parameter '{name}' {tuple(p.shape)} is not sharded; shard the "
                             "model first with parts.partition.partition_module(model) or build "
                             "it inside `with parts.partition.partitioned():`")


def check_group(module: nn.Module, group: Any) -> None:
    """With an explicit ``group``: this rank must be in it and every parameter sharded over it."""
    if group is None:
        return
    if dist.is_available() and dist.is_initialized() and dist.get_rank(group) < 0:
        raise ValueError(f"attach: rank {dist.get_rank()} is not a member of the process group "
                         "passed to FetchCoordinator(group=...); every rank that runs the model "
                         "must be in the group its parameters are sharded over")
    for name, p in module.named_parameters():
        if meta(p).group is not group:
            raise ValueError(f"attach: parameter '{name}' is sharded over another process group "
                             "than the one passed to FetchCoordinator(group=...)")
