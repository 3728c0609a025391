"""State an optimizer made for its shard leaves before its path was settled (a wrapper's constructor:
Lookahead's slow weights), carried over to the tensors the path puts in their place.

On the shard path the entry moves to the shard itself. On the whole and replicated paths each
state tensor shaped like the flat shard is all-gathered to the parameter's full shape (such
state is element-wise: a copy of the values, zeros), one of the full shape (made from a
``ShapedShard``'s shape) is kept as it is; the whole path keeps the entry on the owner only.
A state tensor of any other shape cannot be brought to the full tensor: it is refused, naming
the way out.

The probe makes the same early state for its own tensors where it can tell how it was made
(``template``: a copy of the values, a constant fill, a scalar).
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch

from parts.comm import all_gather, comm_device
from parts.partition.core.param import alloc


def _full(value: torch.Tensor, record: Any) -> torch.Tensor:
    """The parameter-shaped tensor whose shards are every rank's ``value``."""
    info, device = record.info, comm_device(record.info)
    send = value.detach().reshape(-1).to(device)
    recv = alloc(send.numel() * info.world_size, send.dtype, device)
    all_gather(recv, send, info)
    return recv[:record.numel].view(record.shape).to(value.device, copy=True)


def _convert(entry: dict, record: Any, name: str, path: str) -> dict:
    out = {}
    for key, value in entry.items():
        if torch.is_tensor(value) and value.dim() >= 1 and tuple(value.shape) != tuple(record.shape):
            if value.numel() != record.layout.shard_numel:
                raise RuntimeError(
                    f"parts.partition: {name} holds state '{key}' of shape {tuple(value.shape)} for "
                    f"{record.describe()} before its first step, which parts cannot carry to the {path} path it "
                    f"takes: state made before the first step must be shaped like the shard (a copy of the "
                    f"values, zeros) or like the parameter; make "
                    f"'{key}' in the first step instead")
            value = _full(value, record)
        out[key] = value
    return out


def carry(optimizers: list, old: torch.Tensor, new: torch.Tensor, record: Any, path: str, keep: bool) -> None:
    """Move each optimizer's state for ``old`` to ``new`` (converted for ``path``; dropped where not ``keep``)."""
    for optimizer in optimizers:
        if new is old or old not in optimizer.state:
            continue
        entry = optimizer.state.pop(old)
        if path != "shard" and entry:
            entry = _convert(entry, record, type(optimizer).__name__, path)
        if keep:
            optimizer.state[new] = entry


Template = dict[str, tuple[str, Any]]


def _kinds(value: Any, p: torch.Tensor) -> set:
    """How an early state value may have been made from ``p``: a copy of it, a constant fill, a scalar."""
    if not torch.is_tensor(value) or value.dim() == 0:
        return {("value", value)}
    data, flat = p.detach(), value.reshape(-1)
    out = set()
    if value.shape == data.shape and torch.equal(value, data):
        out.add(("copy", None))
    if flat.numel() and value.numel() == data.numel() and bool((flat == flat[0]).all()):
        out.add(("fill", flat[0].item()))
    return out


def template(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> Optional[Template]:
    """The recipe of ``optimizer``'s state made before its first step, the same for every parameter
    (empty: none made; None: one the probe cannot make for its own tensors). A fill is preferred where
    a constant parameter leaves a copy and a fill alike."""
    found: dict[str, list] = {}
    keys: Optional[set] = None
    for p in params:
        entry = optimizer.state.get(p) or {}
        if keys is not None and set(entry) != keys:
            return None
        keys = set(entry)
        for k, v in entry.items():
            kinds = _kinds(v, p)
            found[k] = [c for c in found[k] if c in kinds or c[0] == "value"] if k in found else sorted(
                kinds, key=lambda c: c[0] != "fill")
            if not found[k]:
                return None
    return {k: candidates[0] for k, candidates in found.items()}


def make(recipe: Template, t: torch.Tensor) -> dict:
    """The early state of a fresh tensor ``t`` by ``recipe``."""
    made = {"copy": lambda _: t.detach().clone(), "fill": lambda c: torch.full_like(t, c)}
    return {k: made[kind](arg) if kind in made else copy.deepcopy(arg) for k, (kind, arg) in recipe.items()}
