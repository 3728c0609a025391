"""The whole optimizer state of a sharded model in one dict, as one process would hold it.

``full_optimizer_state_dict(model, optimizer)`` is the layout of torch's
``get_optimizer_state_dict(..., options=StateDictOptions(full_state_dict=True))``:
``{"state": {fqn: {key: value}}, "param_groups": [{..., "params": [fqn, ...]}]}``, every state
tensor sized like a parameter at that parameter's full shape. It is built from
``sharded_optimizer_state_dict``: a shard-sized state tensor is all-gathered over the parameter's
shard group, whole-tensor state (``parts.partition.route``: kept on one owner rank) is sent from
its owner, scalars and the state of unsharded parameters are taken as they are. Every rank takes
part; with ``rank0_only`` only rank 0 keeps the result (``{}`` elsewhere). For inspection, export
and tests: a resumable checkpoint at any world size is ``sharded_optimizer_state_dict`` with DCP,
which never holds a whole state tensor on one rank.

``load_full_optimizer_state_dict(model, optimizer, state)`` is the way back, at any world size
and into a fresh optimizer: rank 0's ``state`` (of the parameters' shard group, where
``full_optimizer_state_dict`` leaves it; of the first replica's in a hybrid layout; other ranks
pass ``None``) is sent one state tensor at
a time (a broadcast), each rank keeps its part of it in the views of
``sharded_optimizer_state_dict`` (its real shard elements; the whole tensor on the owner of a
whole-path parameter) and installs them with ``load_sharded_optimizer_state_dict``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import nn

from parts.comm import (GroupInfo, all_gather, broadcast, broadcast_object, comm_device, resolve_group, to_comm,
                        to_host)
from parts.comm.shard_view import ShardView, is_deferred
from parts.offload.lease import Stored
from parts.partition.core.param import ParamMeta, internal, is_partitioned, meta
from parts.partition.interop.sharded_optim import load_sharded_optimizer_state_dict, sharded_optimizer_state_dict
from parts.partition.whole import stepper_of


def _records(model: nn.Module) -> dict[str, ParamMeta]:
    """FQN -> record of every sharded parameter of ``model``."""
    return {name: meta(p) for name, p in model.named_parameters(remove_duplicate=False) if is_partitioned(p)}


def _full_tensor(m: ParamMeta, holder: Any) -> torch.Tensor:
    """The full tensor at ``m``'s shape from every rank's shard-sized ``holder`` (one all-gather)."""
    local = holder.materialize() if isinstance(holder, Stored) else holder
    flat = to_comm(local.detach().reshape(-1), m.info)
    gathered = torch.empty(m.info.world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
    all_gather(gathered, flat, m.info)
    full = torch.empty(m.numel, dtype=flat.dtype, device=local.device)
    for rank, piece in enumerate(gathered.split(flat.numel())):
        start, stop = m.layout.range(rank)
        full[start:stop].copy_(piece[:stop - start])
    return full.view(m.shape)


def _owned_entry(m: ParamMeta, owner: int, entry: Any) -> Any:
    """The whole-tensor state of ``m`` from its owner (group rank ``owner``) on every rank (None: none yet)."""
    mine = None
    if entry and m.info.rank == owner:  # the owner's views hold its state tensors whole
        mine = {k: to_host(_held(v).detach()) if torch.is_tensor(v) else v for k, v in entry.items()}
    sent = mine if m.info.world_size == 1 else broadcast_object(mine, owner, m.info.group)
    return None if sent is None else {k: v.to(m.shard.device) if torch.is_tensor(v) else v for k, v in sent.items()}


def _held(value: Any) -> Any:
    """The tensor a ShardView made by ``sharded_optimizer_state_dict`` stands for (else ``value``)."""
    return value.holder if isinstance(value, ShardView) else value


def _full_entry(m: ParamMeta, fqn: str, entry: dict) -> dict:
    """One parameter's shard-path state, each ShardView gathered to the full shape."""
    out = {}
    for k, v in entry.items():
        if isinstance(v, ShardView) and v.holder is None:
            raise ValueError(f"full_optimizer_state_dict: '{fqn}.{k}' is a ShardView without its shard-sized tensor")
        out[k] = _full_tensor(m, v.holder) if isinstance(v, ShardView) else _copy(v)
    return out


def _copy(value: Any) -> Any:
    return value.detach().clone() if torch.is_tensor(value) else value


@internal
def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                              rank0_only: bool = True) -> dict[str, Any]:
    """The optimizer's state keyed by FQN at full parameter shapes (on rank 0 only if ``rank0_only``)."""
    sharded = sharded_optimizer_state_dict(model, optimizer)
    records, stepper = _records(model), stepper_of(optimizer)
    keep, state = not rank0_only or _info(records).rank == 0, {}
    for fqn in [fqn for g in sharded["param_groups"] for fqn in g["params"]]:
        m, entry = records.get(fqn), sharded["state"].get(fqn)
        if m is not None and stepper is not None and id(m) in stepper.by_record:
            entry = _owned_entry(m, stepper.owner_of(m), entry)
        elif m is not None and entry:
            entry = _full_entry(m, fqn, entry)
        elif entry:
            entry = {k: _copy(v) for k, v in entry.items()}
        if entry and keep:
            state[fqn] = entry
    if not keep:
        return {}
    return {"state": state, "param_groups": [dict(g) for g in sharded["param_groups"]]}


def _info(records: dict[str, ParamMeta]) -> GroupInfo:
    """The shard group whose rank 0 keeps a ``rank0_only`` result (the world's if nothing is sharded)."""
    return next(iter(records.values())).info if records else resolve_group(None, "full_optimizer_state_dict")


_WHAT = "load_full_optimizer_state_dict"


def _layout(state: Any, template: dict) -> tuple[Optional[str], dict, list]:
    """On the sending rank: (what is wrong or None, FQN -> key -> tensor spec or value, param groups)."""
    if not isinstance(state, Mapping) or not isinstance(state.get("state"), Mapping) \
            or not isinstance(state.get("param_groups"), (list, tuple)):
        return (f"{_WHAT}: state must be full_optimizer_state_dict's layout, {{'state': {{fqn: {{key: value}}}}, "
                f"'param_groups': [...]}}, on rank 0; got {type(state).__name__}"
                + (f" with keys {sorted(map(str, state))}" if isinstance(state, Mapping) else "")), {}, []
    unknown = sorted(set(state["state"]) - set(template["state"]))
    wrong = sorted(f"{fqn}.{k}" for fqn, entry in state["state"].items() if fqn in template["state"]
                   for k in set(entry) ^ set(template["state"][fqn]))
    if unknown or wrong:
        return (f"{_WHAT}: the state does not fit the optimizer: state for parameters it does not step "
                f"{unknown}; state keys only one of the saved state and the optimizer's has: {wrong}"), {}, []
    specs = {fqn: {k: _spec(v) for k, v in entry.items()} for fqn, entry in state["state"].items()}
    return None, specs, [dict(g) for g in state["param_groups"]]


def _spec(value: Any) -> tuple:
    """A state tensor's shape and dtype (it is sent by a broadcast), or the scalar itself (in the object)."""
    if torch.is_tensor(value) and value.dim() >= 1:
        return ("tensor", tuple(value.shape), value.dtype)
    return ("value", to_host(value.detach()) if torch.is_tensor(value) else value)


def _fill(target: Any, full: torch.Tensor) -> Any:
    """``target`` (a view of this rank's part, or a whole value) holding ``full``'s elements."""
    if not isinstance(target, ShardView):
        like = target if torch.is_tensor(target) else full
        return full.to(like.device, like.dtype, copy=True)
    flat = full.reshape(-1)
    for start, piece in target.segments:
        held = piece.materialize() if is_deferred(piece) else piece
        held.copy_(flat[start:start + held.numel()].to(held.device, held.dtype))
        if is_deferred(piece):
            piece.settle()
    return target


class _Source:
    """Sends from the loading rank (rank 0 of the shard group; of the first replica's, in a hybrid layout)
    to every rank: across replicas between the groups' rank 0, then within each group."""

    def __init__(self, records: dict[str, ParamMeta]) -> None:
        self.info = _info(records)
        self.replica = getattr(next(iter(records.values())), "replica", None) if records else None
        self.loads = self.info.rank == 0 and (self.replica is None or self.replica.rank == 0)

    def object(self, make: Any) -> Any:
        """``make()`` on the loading rank, sent to every rank."""
        obj = make() if self.loads else None
        if self.replica is not None and self.info.rank == 0:
            obj = broadcast_object(obj, 0, self.replica.group)
        return broadcast_object(obj, 0, self.info.group) if self.info.world_size > 1 else obj

    def tensor(self, value: Optional[torch.Tensor], shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The loading rank's ``value`` on every rank (on the communication device)."""
        device = comm_device(self.info)
        full = value.detach().to(device, dtype).contiguous() if self.loads else \
            torch.empty(shape, dtype=dtype, device=device)
        if self.replica is not None and self.info.rank == 0:
            broadcast(full, 0, self.replica)
        broadcast(full, 0, self.info)
        return full


@internal
def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                                   state: Optional[Mapping[str, Any]]) -> None:
    """Load rank 0's full optimizer ``state`` (``full_optimizer_state_dict``'s layout) into ``optimizer``
    over ``shards(model)``, at any world size (a collective; other ranks may pass ``None``)."""
    template = sharded_optimizer_state_dict(model, optimizer)  # views of this rank's parts (state made if none)
    source = _Source(_records(model))
    error, specs, groups = source.object(lambda: _layout(state, template))
    if error:
        raise ValueError(error)
    loaded: dict[str, dict] = {}
    for fqn, entry in specs.items():
        loaded[fqn] = {}
        for key, (kind, *spec) in entry.items():
            if kind == "tensor":
                full = source.tensor(state["state"][fqn][key] if source.loads else None, *spec)
                spec = [_fill(template["state"][fqn][key], full)]
            loaded[fqn][key] = spec[0]
    load_sharded_optimizer_state_dict(model, optimizer, {"state": loaded, "param_groups": groups})
