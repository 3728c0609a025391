"""Input checks of ``attach``: clear errors naming the parameter or rank, before any hook."""

from __future__ import annotations

from typing import Any

from torch import nn

from parts.comm import GroupArg, check_member
from parts.partition.core.param import is_partitioned, meta


def check_sharded(module: nn.Module, attached: Any) -> None:
    """An nn.Module, not yet attached (``attached``: module -> coordinator), all params sharded."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"attach: expected an nn.Module, got {type(module).__name__}")
    if module in attached:
        raise RuntimeError(f"attach: {type(module).__name__} already has a FetchCoordinator; "
                           "call its detach() first")
    for name, sub in module.named_modules():
        if sub in attached:  # e.g. adapters wrapped around an attached model (peft's get_peft_model)
            raise RuntimeError(f"attach: submodule '{name}' ({type(sub).__name__}) already has a "
                               "FetchCoordinator; call its detach() first, then attach the whole model")
    for name, p in module.named_parameters():
        if not is_partitioned(p) and p.is_meta:
            raise ValueError(f"attach: parameter '{name}' {tuple(p.shape)} is on the meta device and not "
                             "sharded; to plan without data build it inside "
                             "`parts.partition.partitioned(device='meta')` (then materialize(model) for "
                             "real values), or load its weights first")
        if not is_partitioned(p):
            raise ValueError(f"attach: parameter '{name}' {tuple(p.shape)} is not sharded; shard the "
                             "model first with parts.partition.partition_module(model) or build "
                             "it inside `with parts.partition.partitioned():`")


def check_group(module: nn.Module, group: GroupArg) -> None:
    """With an explicit ``group``: this rank must be in it and every parameter sharded over it."""
    if group is None:
        return
    check_member(group, "attach: FetchCoordinator(group=...)")
    for name, p in module.named_parameters():
        if meta(p).group is not group:
            raise ValueError(f"attach: parameter '{name}' is sharded over another process group "
                             "than the one passed to FetchCoordinator(group=...)")
