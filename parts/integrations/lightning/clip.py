"""Gradient clipping of a parts model under Lightning: by the global norm, or by value, over grad shards.

Lightning clips the parameters an optimizer holds. An optimizer over a parts model holds its
shards (``parts.partition.use_shards``), whose grads are this rank's grad shards: torch's
``clip_grad_norm_`` over them would take this rank's part of the norm for the whole. So
clipping maps an optimizer back to the parameters of the model it steps (recorded when the
strategy set the optimizer up, before its first step settles its path) and clips those:
``parts.partition.clip_grad_norm_`` (the norm over every rank's grad shards, one all-reduce), or
a clamp of every grad shard (element-wise: the same as clamping the full gradient; a hybrid
layout's grads are averaged across replicas first).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from parts.partition import clip_grad_norm_, is_partitioned, meta
from parts.partition.core import disk
from parts.partition.core.param import unique_params
from parts.partition.core.replicas import pending_records, sync_replica_grads
from parts.partition.whole.leaves import record_of_leaf

# an optimizer -> (its module, the parameters of that module it steps), recorded at set-up
_stepped: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()


def is_parts_model(module: Any) -> bool:
    """True for a module with parameters sharded by ``parts.partition``."""
    return isinstance(module, nn.Module) and any(is_partitioned(p) for p in module.parameters())


def _held(optimizer: torch.optim.Optimizer) -> tuple[set, set]:
    """Ids of the tensors ``optimizer`` holds, and of the records behind its shard leaves."""
    held = [t for group in optimizer.param_groups for t in group["params"]]
    return {id(t) for t in held}, {id(r) for r in map(record_of_leaf, held) if r is not None}


def params_stepped_by(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The parameters of ``module`` that ``optimizer`` holds: themselves, their shards or shard leaves."""
    known = _stepped.get(optimizer)
    if known is not None and known[0]() is module:
        return known[1]
    tensors, records = _held(optimizer)

    def held(p: nn.Parameter) -> bool:
        if id(p) in tensors:
            return True
        return is_partitioned(p) and (id(meta(p).shard) in tensors or id(meta(p)) in records)
    return [p for p in unique_params(module.parameters()) if held(p)]


def remember(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Record which parameters of ``module`` ``optimizer`` steps, while it still holds their shards."""
    _stepped.pop(optimizer, None)
    _stepped[optimizer] = (weakref.ref(module), params_stepped_by(module, optimizer))


def module_stepped_by(optimizer: torch.optim.Optimizer, modules: dict[str, nn.Module], what: str) -> nn.Module:
    """The one of ``modules`` whose parameters ``optimizer`` steps (``what`` names the optimizer in errors)."""
    known = _stepped.get(optimizer)
    if known is not None and any(known[0]() is m for m in modules.values()):
        return known[0]()
    found = [m for m in modules.values() if params_stepped_by(m, optimizer)]
    if len(found) != 1:
        raise ValueError(f"parts strategy: {what} steps the parameters of {len(found)} of the modules "
                         f"{sorted(modules)} in the state; save and load it beside the one module it steps")
    return found[0]


def clip_by_norm(module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float,
                 norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the grads of what ``optimizer`` steps of ``module`` to a global norm of at most
    ``max_norm``; return the norm before clipping (a collective: every rank calls it)."""
    params = params_stepped_by(module, optimizer)
    return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)


def clip_by_value(module: nn.Module, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
    """Clamp every grad (shard) of what ``optimizer`` steps of ``module`` to ``[-clip_val, clip_val]``."""
    params = params_stepped_by(module, optimizer)
    sync_replica_grads(pending_records(params))  # the clamp acts on the mean over replicas
    grads = [_grad(p) for p in params]
    with torch.no_grad():
        for grad in grads:
            if grad is not None:
                grad.clamp_(-clip_val, clip_val)


def _grad(p: nn.Parameter) -> Any:
    """This rank's grad of ``p``: its grad shard, or ``p.grad`` for a parameter that is not sharded."""
    if not is_partitioned(p):
        return p.grad
    if disk.has_grad(meta(p).shard):
        raise NotImplementedError(f"parts strategy: clipping by value of {meta(p).describe()}, whose grad "
                                  f"shard is in a DiskStore, is not supported; clip by norm "
                                  f"(gradient_clip_algorithm='norm')")
    return meta(p).grad_shard
