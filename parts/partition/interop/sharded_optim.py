"""Sharded optimizer state dicts for ``torch.distributed.checkpoint`` (DCP), at any world size.

For any torch optimizer over ``shards(model)`` (``parts.offload.OffloadedOptimizer``
included) the dict is what torch's ``get_optimizer_state_dict`` gives FSDP2 users:
``{"state": {fqn: {key: value}}, "param_groups": [{..., "params": [fqn, ...]}]}``. A state
tensor sized like the shard (``exp_avg``...) is a ``ShardView`` of the global parameter
shape over this rank's real elements; scalars (``step``) are replicated values. An optimizer on the whole-tensor path
(``parts.partition.route``) keeps each parameter's state on its owner only: that rank's dict
holds it whole, under the same keys, and a load at another world size reads it on the new owner. An
optimizer with no state yet (just built, about to load) first takes one step with
learning rate 0 and zero grads, as torch's ``get_optimizer_state_dict`` does, so that
every state tensor exists for ``dcp.load`` to fill (weights are unchanged by it).
``OffloadedOptimizer``'s state tensors stay in its store (``stored_state_dict``): their views
are deferred, read when DCP saves them and written there when DCP loads them, one at a time.

An optimizer with its own layout (``parts.optim.BF16Optimizer``) provides
``sharded_state_dict(model)`` / ``load_sharded_state_dict(model, state)`` itself; these
functions call them.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from parts.base.wrapper import init_state
from parts.offload.lease import Stored
from parts.partition.core.param import ParamMeta, internal, is_partitioned, meta
from parts.partition.interop.sharded_state import shard_view
from parts.partition.whole import route, stepper_of


def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _names(model: nn.Module) -> dict[int, tuple[str, Any]]:
    """id of what an optimizer steps (a shard, or an unsharded parameter) -> (FQN, its record or None)."""
    out: dict[int, tuple[str, Any]] = {}
    for name, p in model.named_parameters():
        if is_partitioned(p):
            out.setdefault(id(meta(p).shard), (name, meta(p)))
        else:
            out.setdefault(id(p), (name, None))
    return out


def _fqns(model: nn.Module, optimizer: torch.optim.Optimizer, what: str) -> list[tuple[str, Any]]:
    """(FQN, record) of every tensor the optimizer steps, in its order; raises for a stranger."""
    route(optimizer)
    names = _names(model)
    stepper = stepper_of(optimizer)
    if stepper is not None:  # whole tensors (owner) and placeholders (elsewhere) stand for their parameters
        for fqn, record in list(names.values()):
            if record is not None and id(record) in stepper.by_record:
                names[id(stepper.by_record[id(record)])] = (fqn, record)
    out = []
    for i, p in enumerate(_params_of(optimizer)):
        if id(p) not in names:
            raise ValueError(f"{what}: the optimizer's tensor #{i} (shape {tuple(p.shape)}) is neither a shard "
                             f"of a parameter of the model (shards(model)) nor one of its parameters")
        out.append(names[id(p)])
    return out


@internal
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a stateless optimizer its state: one step with lr 0 on zero grads (weights unchanged)."""
    if any(optimizer.state.get(p) for p in _params_of(optimizer)):
        return
    params = _params_of(optimizer)  # shards need not require grad: their .grad is set, not computed
    if any(p.grad is not None for p in params):
        raise RuntimeError("sharded_optimizer_state_dict: the optimizer has no state yet but its tensors have "
                           "grads; call it before backward (or after zero_grad) so its state can be made")
    try:
        init_state(optimizer)
    finally:
        optimizer.zero_grad(set_to_none=True)  # what a wrapping optimizer keeps beside .grad too


def _state_value(value: Any, record: ParamMeta | None, name: str) -> Any:
    """A shard-sized state tensor as a ShardView; anything else (scalars, unsharded state) as it is."""
    if record is not None and (torch.is_tensor(value) or isinstance(value, Stored)) and value.dim() >= 1 \
            and value.numel() == record.layout.shard_numel:
        return shard_view(record, value, name)
    return value


@internal
def sharded_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by FQN, shard-sized tensors as DCP views (see the module docstring)."""
    if hasattr(optimizer, "sharded_state_dict"):
        return optimizer.sharded_state_dict(model)
    fqns = _fqns(model, optimizer, "sharded_optimizer_state_dict")
    init_optimizer_state(optimizer)
    stored = getattr(optimizer, "stored_state_dict", None)  # OffloadedOptimizer: nothing read now
    torch_sd = stored() if stored is not None else optimizer.state_dict()  # references to the state
    state = {}
    stepper = stepper_of(optimizer)
    for i, (fqn, record) in enumerate(fqns):
        entry = torch_sd["state"].get(i)
        if entry and stepper is not None and id(record) in stepper.by_record:
            if stepper.owns(record):  # whole-tensor state lives on the owner only, saved whole
                state[fqn] = dict(entry)
        elif entry:
            state[fqn] = {k: _state_value(v, record, f"{fqn}.{k}") for k, v in entry.items()}
    groups, offset = [], 0
    for g in torch_sd["param_groups"]:
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [fqns[offset + j][0] for j in range(len(g["params"]))]})
        offset += len(g["params"])
    return {"state": state, "param_groups": groups}


def _loaded_value(value: Any, where: str) -> Any:
    """What to hand ``optimizer.load_state_dict`` for a loaded entry (a view's shard-sized holder)."""
    from parts.comm.dcp import ShardView
    if isinstance(value, ShardView):
        if value.holder is None:
            raise ValueError(f"load_sharded_optimizer_state_dict: {where} is a ShardView not made by "
                             f"sharded_optimizer_state_dict")
        return value.holder
    return value


def _groups_for(saved: list, fqns: list[tuple[str, Any]], optimizer: torch.optim.Optimizer) -> list[dict]:
    """Saved group options for each current group (matched by their FQNs), current indices."""
    by_names = {frozenset(g.get("params", [])): g for g in saved}
    out, offset = [], 0
    for n, g in enumerate(optimizer.param_groups):
        names = [fqns[offset + j][0] for j in range(len(g["params"]))]
        match = by_names.get(frozenset(names))
        if match is None:
            raise ValueError(f"load_sharded_optimizer_state_dict: the optimizer's param group {n} ({names}) "
                             f"matches no saved group (saved: {[g.get('params') for g in saved]})")
        out.append({**{k: v for k, v in match.items() if k != "params"},
                    "params": list(range(offset, offset + len(names)))})
        offset += len(names)
    return out


@internal
def load_sharded_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                                      state: Mapping[str, Any]) -> None:
    """Install what ``dcp.load`` filled into ``sharded_optimizer_state_dict(model, optimizer)``."""
    if hasattr(optimizer, "load_sharded_state_dict"):
        optimizer.load_sharded_state_dict(model, state)
        return
    if not isinstance(state, Mapping) or "state" not in state or "param_groups" not in state:
        raise ValueError("load_sharded_optimizer_state_dict: state must be the dict sharded_optimizer_state_dict "
                         "returned, filled by dcp.load (keys 'state' and 'param_groups')")
    from parts.comm.dcp import settle
    settle(dict(state))  # what DCP wrote into stored state tensors goes to their store
    fqns = _fqns(model, optimizer, "load_sharded_optimizer_state_dict")
    index = {fqn: i for i, (fqn, _) in enumerate(fqns)}
    unknown = sorted(set(state["state"]) - set(index))
    if unknown:
        raise ValueError(f"load_sharded_optimizer_state_dict: state for {unknown}, which the optimizer does not step")
    torch_sd = {"state": {index[fqn]: {k: _loaded_value(v, f"'{fqn}.{k}'") for k, v in entry.items()}
                          for fqn, entry in state["state"].items()},
                "param_groups": _groups_for(list(state["param_groups"]), fqns, optimizer)}
    optimizer.load_state_dict(torch_sd)
