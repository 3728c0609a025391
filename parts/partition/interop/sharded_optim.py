"""Sharded optimizer state dicts for ``torch.distributed.checkpoint`` (DCP), at any world size.

For any torch optimizer over ``shards(model)`` (``parts.offload.OffloadedOptimizer``
included) the dict is what torch's ``get_optimizer_state_dict`` gives FSDP2 users:
``{"state": {fqn: {key: value}}, "param_groups": [{..., "params": [fqn, ...]}]}``. A state
tensor sized like the shard (``exp_avg``...) is a ``ShardView`` of the global parameter
shape over this rank's real elements; scalars (``step``) are replicated values. An optimizer
on the whole-tensor path (``parts.partition.route``) keeps each parameter's state whole on its
owner only (on the replicated path: on every rank). Every rank's dict still has the same keys:
the views of the ranks that hold the state cover it whole (``owned_state``), and a load at
any world size reads it on the ranks that hold that parameter's state then. An optimizer with
no state yet (just built, about to load) first takes one step with learning rate 0 and zero
grads, as torch's ``get_optimizer_state_dict`` does, so that every state tensor exists for
``dcp.load`` to fill (weights are unchanged by it).
``OffloadedOptimizer``'s state tensors stay in its store (``stored_state_dict``): their views
are deferred, read when DCP saves them and written there when DCP loads them, one at a time.

An optimizer with its own layout (``parts.optim.BF16Optimizer``) provides
``sharded_state_dict(model)`` / ``load_sharded_state_dict(model, state)`` itself; these
functions call them. Any other optimizer's ``state_dict()`` must be torch's layout (``state``
by index, ``param_groups`` listing the indices); one that is not is refused, naming what it lacks.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from parts.base.wrapper import init_state
from parts.offload.lease import Stored
from parts.partition.core.param import ParamMeta, internal, is_partitioned, meta
from parts.partition.interop.owned_state import any_rank_has_state, held_elsewhere, owned_state
from parts.partition.interop.sharded_state import shard_view
from parts.partition.whole import route, stepper_of
from parts.partition.whole.leaves import record_of_leaf


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


def steps_model(model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """True if ``optimizer`` steps a sharded parameter of ``model``: its shard, a shard leaf of
    ``shards(model)`` or a full tensor standing for it on a full-tensor path (no collective)."""
    records = {id(meta(p).shard): id(meta(p)) for p in model.parameters() if is_partitioned(p)}
    stepper = stepper_of(optimizer)
    if stepper is not None:
        records.update({id(t): rid for rid, t in stepper.by_record.items() if rid in records.values()})
    mine = set(records.values())
    for p in _params_of(optimizer):
        leaf = record_of_leaf(p)
        if (id(leaf) if leaf is not None else records.get(id(p))) in mine:
            return True
    return False


@internal
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a stateless optimizer its state: one step with lr 0 on zero grads (weights unchanged)."""
    has_state = any(optimizer.state.get(p) for p in _params_of(optimizer))
    stepper = stepper_of(optimizer)
    if stepper is not None:  # a rank that owns no parameter holds no state: the ranks decide together
        has_state = any_rank_has_state(stepper, has_state)
    if has_state:
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
    _check_layout(torch_sd, optimizer, len(fqns))
    state, stepper = {}, stepper_of(optimizer)
    whole = [(i, fqn, record) for i, (fqn, record) in enumerate(fqns)
             if stepper is not None and record is not None and id(record) in stepper.by_record]
    held = {fqn for _, fqn, _ in whole}
    for i, (fqn, record) in enumerate(fqns):
        entry = torch_sd["state"].get(i)
        if entry and fqn not in held:
            state[fqn] = {k: _state_value(v, record, f"{fqn}.{k}") for k, v in entry.items()}
    if whole:  # full-tensor state: held whole by owners (or every rank), the same keys on every rank
        state.update(owned_state(stepper, whole, torch_sd["state"]))
    return {"state": state, "param_groups": _named_groups(torch_sd["param_groups"], fqns)}


def _named_groups(groups: list, fqns: list[tuple[str, Any]]) -> list[dict]:
    """torch's param groups with the FQNs of their parameters in place of the indices."""
    out, offset = [], 0
    for g in groups:
        out.append({**{k: v for k, v in g.items() if k != "params"},
                    "params": [fqns[offset + j][0] for j in range(len(g["params"]))]})
        offset += len(g["params"])
    return out


def _check_layout(torch_sd: Any, optimizer: torch.optim.Optimizer, count: int) -> None:
    """Refuse a ``state_dict()`` not in torch's layout, naming what it lacks and the way out."""
    name = type(optimizer).__name__
    lacks = [k for k in ("state", "param_groups") if not isinstance(torch_sd, Mapping) or k not in torch_sd]
    if not lacks:
        listed = sum(len(g.get("params", ())) for g in torch_sd["param_groups"] if isinstance(g, Mapping))
        if listed != count:
            lacks = [f"param_groups listing its {count} parameters (they list {listed})"]
    if lacks:
        has = sorted(map(str, torch_sd)) if isinstance(torch_sd, Mapping) else type(torch_sd).__name__
        raise TypeError(
            f"sharded_optimizer_state_dict: {name}.state_dict() is not in torch's layout: it has no {lacks} "
            f"(it has {has}). parts saves optimizer state per parameter, {{'state': {{index: {{...}}}}, "
            f"'param_groups': [{{..., 'params': [index, ...]}}]}} over {name}.param_groups, so that it loads at "
            f"any world size. Give {name} a state_dict()/load_state_dict() in that layout (an optimizer "
            f"combining others can share their param group dicts and one state dict), or the methods "
            f"sharded_state_dict(model) and load_sharded_state_dict(model, state), which parts then calls")


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
    stepper = stepper_of(optimizer)
    torch_sd = {"state": {index[fqn]: {k: _loaded_value(v, f"'{fqn}.{k}'") for k, v in entry.items()}
                          for fqn, entry in state["state"].items()
                          if not held_elsewhere(optimizer, stepper, fqns[index[fqn]][1])},
                "param_groups": _groups_for(list(state["param_groups"]), fqns, optimizer)}
    optimizer.load_state_dict(torch_sd)
