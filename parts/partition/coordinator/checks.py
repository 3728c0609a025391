"""Input checks of ``attach``: clear errors naming the parameter or rank, before any hook."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from torch import nn

from parts.comm import (GroupArg, GroupInfo, ProcessGroup, check_member, global_rank,
                        group_info, is_distributed)
from parts.comm.agree import check_layouts, exchange_in_rounds
from parts.comm.failure import attempt
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


# ------------------------------------------------------------------ agreed across ranks
# What every rank of a model must pass alike: a rank with another compression policy, another
# secondary group, another precision or knob, or another layout (a mesh of another shape)
# would issue other collectives than its peers: a hang at the first step, or a silent
# mismatch (codes read as values). ``agree_to_attach`` runs the checks above on every rank
# and exchanges each rank's settings in one collective before any hook is installed; a failure
# or a difference raises on every rank, naming the option and the ranks.
_OPTIONS = ("compression", "mixed_precision", "sync_buffers", "secondary_group", "params")


def _first_record(module: Any) -> Any:
    """The record of ``module``'s first sharded parameter (None if it has none)."""
    if not isinstance(module, nn.Module):
        return None
    return next((meta(p) for p in module.parameters() if is_partitioned(p)), None)


def agreement_scopes(module: Any, group: GroupArg) -> list[GroupInfo]:
    """The groups to agree over: the world when this rank's layout (shard group times replica
    group) spans it, so every rank of any layout meets in one exchange; else the shard group,
    then the replica group. Empty when not distributed."""
    if not is_distributed():
        return []
    record = _first_record(module)
    shard = group_info(group, "attach: FetchCoordinator(group=...)") if group is not None or record is None \
        else record.info
    replica = record.replica if record is not None and group is None else None
    span = shard.world_size * (replica.world_size if replica is not None else 1)
    if span == group_info(None).world_size:
        return [group_info(None)]
    return [shard] if replica is None else [shard, replica]


def _settings(module: nn.Module, coordinator: Any) -> dict:
    """What must be alike on every rank: this rank's layout and options (picklable)."""
    record = _first_record(module)
    secondary = coordinator.secondary_group
    if secondary is not None and not isinstance(secondary, ProcessGroup):
        raise TypeError(f"attach(secondary_group=...): takes a process group (this node's ranks, "
                        f"e.g. torch.distributed.new_group), got {type(secondary).__name__}")
    params = [p for p in module.parameters() if is_partitioned(p)]
    topology = getattr(record.info, "topology", None) if record is not None else None
    return {"rank": global_rank(),
            "shard": tuple(record.info.global_ranks()) if record is not None else (),
            "replicas": tuple(record.replica.global_ranks()) if record is not None and record.replica else None,
            "ranks_per_node": getattr(topology, "per_node", None),
            "compression": coordinator.compression, "mixed_precision": coordinator.mixed_precision,
            "sync_buffers": coordinator.sync_buffers, "knobs": coordinator.knobs,
            "secondary_group": None if secondary is None else
            f"a group of {group_info(secondary, 'attach(secondary_group=...)').world_size} rank(s)",
            "params": f"{len(params)} sharded parameters of {sum(meta(p).numel for p in params)} elements"}


def agree_to_attach(module: Any, coordinator: Any, attached: Any,
                    failed: Optional[BaseException] = None) -> None:
    """The checks of ``attach`` on every rank, and the ranks' settings compared, in one exchange
    (two for a layout on part of the world with replicas): a failure on any rank (``failed``:
    this rank's, met before) or a difference raises on every rank, before any hook."""
    def local() -> dict:
        if failed is not None:
            raise failed
        check_sharded(module, attached)
        check_group(module, coordinator.group)
        return _settings(module, coordinator)
    mine, own = attempt(local, global_rank())
    scopes = agreement_scopes(module, None if failed is not None else coordinator.group)
    seen = exchange_in_rounds(mine, scopes, lambda s: s["rank"], own, "attach")
    _compare(sorted(seen, key=lambda s: s["rank"]))


def _compare(every: list[dict]) -> None:
    """Raise the first difference among ``every`` rank's settings (the same on every rank)."""
    check_layouts({s["rank"]: (s["shard"], s["replicas"]) for s in every}, "attach")
    for option in ("ranks_per_node", *_OPTIONS):
        _alike(every, option, lambda s, o=option: s[o])
    for knob in dataclasses.fields(every[0]["knobs"]):
        _alike(every, knob.name, lambda s, k=knob.name: getattr(s["knobs"], k))


def _alike(every: list[dict], option: str, value: Callable[[dict], Any]) -> None:
    """Raise a ValueError naming ``option`` and who passed what if ranks differ on it."""
    passed: dict[str, list[int]] = {}
    for s in every:
        passed.setdefault(repr(value(s)), []).append(s["rank"])
    if len(passed) > 1:
        who = "; ".join(f"global rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {v}"
                        for v, r in passed.items())
        raise ValueError(f"attach: the ranks of the model disagree on {option} ({who}); every rank "
                         f"must pass the same (each would issue other collectives: a hang or wrong values)")


def external_of(table: Any, module: nn.Module, param: nn.Parameter) -> tuple[int, int]:
    """(module index, parameter id) for ``register_external_parameter``; ValueError naming the module
    if either is not part of the attached model."""
    index = table.index.get(id(module))
    if index is None:
        raise ValueError(f"register_external_parameter: module {type(module).__name__} is not "
                         "part of the model this coordinator is attached to")
    if not is_partitioned(param) or meta(param).id not in table.params:
        raise ValueError("register_external_parameter: the parameter is not a sharded parameter "
                         f"of the attached model (module '{table.names[index]}')")
    return index, meta(param).id
