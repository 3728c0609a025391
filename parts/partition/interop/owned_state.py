"""Optimizer state of full-tensor paths in sharded state dicts: the same keys on every rank.

On the whole-tensor path (``parts.partition.route``) a parameter's optimizer state exists on
its owner rank only, whole; on the replicated path every rank holds it whole. A DCP checkpoint
must still show every rank the same keys: a strict load (``parts.comm.dcp.load``, the
integrations' checkpoints) refuses a state dict whose keys differ from the checkpoint's, and
at another world size a parameter's owner changes. So every rank's dict holds the state of
every such parameter under the same keys:

- a state tensor of one or more dimensions is a ``ShardView`` of its full shape: on a rank that
  holds the state one segment covering it all (its ``holder`` is the state tensor), elsewhere no
  segment. So the holders write it (DCP keeps one copy of what several ranks write alike) and
  whoever holds the parameter's state at load (its owner, or every rank) reads it whole;
- a scalar (``step``, a 0-dim tensor, a float) is a holder's value on every rank, so DCP's
  one replicated copy is that value.

The keys, shapes and scalars come from one exchange of small objects over the optimizer's
group (``all_gather_objects``); no state tensor leaves its rank.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from parts.comm import ReduceOp, all_gather_objects, all_reduce, comm_device, to_host
from parts.comm.shard_view import ShardView

_TENSOR = "tensor"


def _spec(value: Any) -> tuple:
    """What a non-owner needs to hold ``value``'s place: its shape and dtype, or the scalar itself."""
    if torch.is_tensor(value) and value.dim() >= 1:
        return (_TENSOR, tuple(value.shape), value.dtype)
    return ("value", to_host(value.detach()).clone() if torch.is_tensor(value) else value)


def _view(spec: tuple, own: Any, device: torch.device, name: str) -> ShardView:
    """A view of the full shape: the whole of ``own`` on its owner, nothing elsewhere (``own`` None)."""
    _, shape, dtype = spec
    if own is None:
        return ShardView(shape, [], dtype=dtype, device=device, name=name)
    holder = own.detach() if own.is_contiguous() else own.detach().contiguous()
    return ShardView(shape, [(0, holder.view(-1))], dtype=dtype, device=holder.device, name=name, holder=holder)


def owned_state(stepper: Any, named: list[tuple[int, str, Any]], state: Mapping[int, Any]) -> dict[str, dict]:
    """FQN -> state entry of every parameter the stepper holds that has state on some rank, the same
    keys on every rank.

    ``named``: (index in the optimizer's state dict, FQN, record) of each parameter the stepper
    holds; ``state``: the optimizer's ``state_dict()["state"]`` on this rank."""
    mine, specs = {}, {}
    for i, fqn, _ in named:
        entry = state.get(i)
        if entry:
            mine[fqn] = entry
            specs[fqn] = {k: _spec(v) for k, v in entry.items()}
    every: dict[str, dict] = {}
    for theirs in all_gather_objects(specs, stepper.info.group):
        for fqn, spec in theirs.items():
            every.setdefault(fqn, spec)
    out = {}
    for _, fqn, record in named:
        if fqn in every:
            own = mine.get(fqn)
            out[fqn] = {k: _view(spec, own[k] if own else None, record.shard.device, f"{fqn}.{k}")
                        if spec[0] == _TENSOR else (own[k] if own else spec[1]) for k, spec in every[fqn].items()}
    return out


def held_elsewhere(optimizer: Any, stepper: Any, record: Any) -> bool:
    """True if the stepper holds ``record``'s parameter and this rank has no state for it (another
    rank steps it: its entry here is a placeholder)."""
    if stepper is None or id(record) not in stepper.by_record:
        return False
    return not optimizer.state.get(stepper.by_record[id(record)])


def any_rank_has_state(stepper: Any, mine: bool) -> bool:
    """Whether some rank of the stepper's group holds state (a rank may own no parameter at all)."""
    flag = torch.tensor([int(mine)], dtype=torch.int32, device=comm_device(stepper.info))
    return bool(all_reduce(flag, stepper.info, ReduceOp.MAX).item())
