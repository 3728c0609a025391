"""Which tensors of a DCP checkpoint are the model an export writes, and under which keys.

A checkpoint is a dict of things: ``dcp.save({"model": sharded_state_dict(model), "optimizer":
sharded_optimizer_state_dict(model, optimizer)})`` stores ``model.<fqn>`` tensors beside
``optimizer.state.<fqn>.exp_avg`` tensors and ``optimizer.param_groups.0.lr`` bytes. A top-level
entry whose keys all lie under ``state.`` or ``param_groups.`` is an optimizer's state, exported
only when ``prefix`` names it; non-tensor entries have no place in safetensors. With ``prefix``
given, the tensors under it are exported without it (``""``: the keys as they are). Without,
when the model's tensors all lie under one top-level key, that key is the prefix (a peft
model's own ``base_model.`` excepted); the other ways to read the keys follow, for a check
against the model's architecture to choose.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Optional

from parts.comm.dcp_read import CheckpointIndex, StoredTensor
from parts.export import peft

_OPTIMIZER_PARTS = ("state", "param_groups")


@dataclass(frozen=True)
class Selection:
    """The tensors to export, renamed without ``prefix``, and the top-level entries left out."""

    prefix: str
    tensors: list[StoredTensor]
    left_out: list[str]


def _top(key: str) -> str:
    return key.split(".", 1)[0]


def optimizer_entries(keys: Iterable[str]) -> set[str]:
    """The top-level entries of ``keys`` that hold an optimizer's state (all under ``state.`` / ``param_groups.``)."""
    parts: dict[str, set[str]] = {}
    for key in keys:
        head, _, rest = key.partition(".")
        parts.setdefault(head, set()).add(rest.split(".", 1)[0] if rest else "")
    return {head for head, seen in parts.items() if seen <= set(_OPTIMIZER_PARTS) and "state" in seen}


def _model_tensors(index: CheckpointIndex) -> list[StoredTensor]:
    """The checkpoint's tensors outside its optimizer entries."""
    optimizers = optimizer_entries([*index.tensors, *index.skipped])
    return [t for t in index if _top(t.key) not in optimizers]


def _strip(tensors: list[StoredTensor], prefix: str) -> list[StoredTensor]:
    head = prefix.rstrip(".") + "."
    return [dataclasses.replace(t, key=t.key[len(head):]) for t in tensors if t.key.startswith(head)]


def _selection(index: CheckpointIndex, tensors: list[StoredTensor], prefix: str) -> Selection:
    chosen = _strip(tensors, prefix) if prefix else tensors
    kept = {_top(t.key) for t in tensors if not prefix or t.key.startswith(prefix.rstrip(".") + ".")}
    everything = {_top(k) for k in [*index.tensors, *index.skipped]}
    return Selection(prefix.rstrip("."), chosen, sorted(everything - kept))


def _groups(tensors: list[StoredTensor]) -> list[str]:
    """The top-level keys holding the tensors, in order of first appearance; a key without a dot is its own."""
    return list(dict.fromkeys(t.key.split(".", 1)[0] + ("." if "." in t.key else "") for t in tensors))


def candidates(index: CheckpointIndex, prefix: Optional[str]) -> list[Selection]:
    """The ways to read the checkpoint's model: the given ``prefix`` alone, or the default first."""
    if prefix:  # a named entry, an optimizer's too
        if not _strip(list(index), prefix):
            raise ValueError(f"export: no tensor of checkpoint {index.directory} is under prefix {prefix!r} "
                             f"(its keys begin {sorted(index.tensors)[:3]})")
        return [_selection(index, list(index), prefix)]
    tensors = _model_tensors(index)
    if not tensors:
        raise ValueError(f"export: checkpoint {index.directory} holds no tensor outside its optimizer state "
                         f"(its entries: {sorted({_top(k) for k in [*index.tensors, *index.skipped]})})")
    if prefix is not None:
        return [_selection(index, tensors, "")]
    groups = _groups(tensors)
    wrapped = len(groups) == 1 and groups[0].endswith(".") and not (
        peft.PREFIX.startswith(groups[0]) and peft.is_peft(t.key for t in tensors))
    named = [g[:-1] for g in groups if g.endswith(".")]
    return [_selection(index, tensors, p) for p in ([named[0], ""] if wrapped else ["", *named])]
