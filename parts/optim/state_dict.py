"""BF16Optimizer state dicts: per-rank dicts that re-slice at any world size, and a consolidated form.

A rank's dict holds, per group, the real (unpadded) elements of its fp32 master
partition and of every per-element optimizer state tensor, plus per-parameter
metadata (name, shape, group, flat offset or shard layout). Loading maps each
parameter piece this rank now owns back to the saved ranks that held it
(``layout.source_ranges``), so 2->3 or 4->2 needs no offline conversion. Only
tensors, numbers, strings, lists, tuples and dicts: ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from parts.comm import agree

from . import _collectives as C
from . import inner_state
from .inner_state import is_elementwise as _is_elementwise
from .load_checks import group_options
from .flat_group import FlatGroup
from .masters import Masters
from .reader import FORMAT, Reader, Source
from .sharded import ShardedParam

StateValue = Union[torch.Tensor, float, int]  # a state tensor, or a scalar such as a step count


def flat_state(inner: torch.optim.Optimizer, fg: FlatGroup) -> dict:
    """The wrapped optimizer's state of ``fg``'s master chunks, merged into partition-sized tensors."""
    states = [inner_state.full(inner, c) for c in fg.master_chunks]
    if not states or not states[0]:
        return {}
    out = {}
    for key, v0 in states[0].items():
        if _is_elementwise(v0, fg.master_chunks[0]):
            parts = [st[key].reshape(-1) for st in states]
            out[key] = parts[0] if len(parts) == 1 else torch.cat(parts)
        else:
            out[key] = v0
    return out


def set_flat_state(inner: torch.optim.Optimizer, fg: FlatGroup, state: dict) -> None:
    """Split partition-sized ``state`` over ``fg``'s master chunks (each gets its own scalars)."""
    for chunk, (start, length) in zip(fg.master_chunks, fg.chunks):
        inner_state.replace(inner, chunk, {
            k: (v.reshape(-1).narrow(0, start, length).clone() if _is_elementwise(v, fg.master)
                else (v.clone() if torch.is_tensor(v) else v)) for k, v in state.items()})


def _split_state(state: dict, master: torch.Tensor, real: int) -> tuple[dict, dict]:
    """(per-element state as real-element slices, everything else) of one master tensor."""
    elem, other = {}, {}
    for key, value in state.items():
        if _is_elementwise(value, master):
            elem[key] = value.reshape(-1).narrow(0, 0, real).clone()
        else:
            other[key] = value.clone() if torch.is_tensor(value) else value
    return elem, other


def _options(opt: Masters) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]


def _param_meta(opt: Masters) -> list[dict]:
    out = []
    for g, fg in enumerate(opt.flat_groups):
        for i, (p, name) in enumerate(zip(fg.params if fg else [], fg.names if fg else [])):
            out.append({"name": name, "shape": list(p.shape), "group": g, "kind": "flat",
                        "offset": fg.layout.offsets[i], "slot": i})
        for j, s in enumerate(opt.sharded_groups[g]):
            out.append({"name": s.name, "shape": list(s.shape), "group": g, "kind": "sharded",
                        "shard_numel": s.layout.shard_numel, "slot": j})
    return out


def _record(master: torch.Tensor, state: dict, real: int, start: int) -> dict:
    elem, other = _split_state(state, master, real)
    return {"range": [start, start + real], "master": master.narrow(0, 0, real).clone(),
            "state": elem, "scalars": other}


def _scalars(opt: Masters, master: torch.Tensor) -> dict:
    """Copies of ``master``'s state entries that are not per-element (step counters...)."""
    return {k: v.clone() if torch.is_tensor(v) else v
            for k, v in inner_state.scalars(opt.optimizer, master).items()}


def _sharded_record(opt: Masters, s: ShardedParam) -> dict:
    """``_record`` of one sharded param, one tensor at a time (offloaded ones read from the store)."""
    real, start = s.real_numel(), s.layout.range(opt.rank)[0]
    with s.peek_master():
        master = s.master.narrow(0, 0, real).clone()
    elem = {k: inner_state.tensor(opt.optimizer, s.master, k).reshape(-1).narrow(0, 0, real).clone()
            for k in inner_state.keys(opt.optimizer, s.master)}
    return {"range": [start, start + real], "master": master, "state": elem,
            "scalars": _scalars(opt, s.master)}


def rank_state_dict(opt: Masters) -> dict:
    """This rank's checkpoint: real master/state elements, options and parameter metadata."""
    opt.sync_masters()
    groups = []
    for fg in opt.flat_groups:
        if fg is None:
            groups.append(None)
            continue
        rec = _record(fg.master, flat_state(opt.optimizer, fg), fg.real_numel(),
                      fg.layout.shard.range(opt.rank)[0])
        rec["partition_numel"] = fg.layout.partition_numel
        groups.append(rec)
    sharded = [[_sharded_record(opt, s) for s in sh] for sh in opt.sharded_groups]
    return {"format": FORMAT, "kind": "rank", "world_size": opt.world_size, "rank": opt.rank,
            "param_groups": _options(opt), "params": _param_meta(opt), "groups": groups,
            "sharded": sharded, "skipped_steps": opt.skipped_steps,
            "loss_scaler": opt.loss_scaler.state_dict() if opt.loss_scaler else None}


def _gather_full(opt: Masters, master: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
    full = C.all_gather_partition(master, opt.comm)
    elem = {k: C.all_gather_partition(v.reshape(-1), opt.comm)
            for k, v in state.items() if _is_elementwise(v, master)}
    return full, elem


def _full_sharded(opt: Masters, s: ShardedParam, key: Optional[str],
                  keep: bool = True) -> Optional[torch.Tensor]:
    """The full master (``key`` None) or state ``key`` of one sharded param, gathered from its one
    local tensor (read from the store if offloaded), padding cut; None if not ``keep``."""
    if key is None:
        with s.peek_master():
            full = C.all_gather_partition(s.master, opt.comm)
    else:
        full = C.all_gather_partition(inner_state.tensor(opt.optimizer, s.master, key).reshape(-1), opt.comm)
    return full.narrow(0, 0, s.numel).view(s.shape).clone() if keep else None


def consolidated_state_dict(opt: Masters) -> Optional[dict]:
    """Full per-parameter fp32 master and state on rank 0, one group at a time (a collective)."""
    opt.sync_masters()
    masters, states, scalars = {}, {}, {}
    keep = opt.rank == 0

    def add(name: str, shape: list, full: torch.Tensor, elem: dict, off: int, other: dict):
        if keep:
            n = 1
            for d in shape:
                n *= d
            masters[name] = full.narrow(0, off, n).view(shape).clone()
            states[name] = {k: v.narrow(0, off, n).view(shape).clone() for k, v in elem.items()}
            scalars[name] = other

    for g, fg in enumerate(opt.flat_groups):
        if fg is not None:
            state = flat_state(opt.optimizer, fg)
            full, elem = _gather_full(opt, fg.master, state)
            other = _split_state(state, fg.master, 0)[1]
            for i, (p, name) in enumerate(zip(fg.params, fg.names)):
                add(name, list(p.shape), full, elem, fg.layout.offsets[i], other)
            del full, elem
        for s in opt.sharded_groups[g]:
            keys = inner_state.keys(opt.optimizer, s.master)
            master = _full_sharded(opt, s, None, keep)
            elem = {k: _full_sharded(opt, s, k, keep) for k in keys}
            if keep:
                masters[s.name], states[s.name], scalars[s.name] = master, elem, _scalars(opt, s.master)
    if not keep:
        return None
    return {"format": FORMAT, "kind": "consolidated", "param_groups": _options(opt),
            "params": [{k: m[k] for k in ("name", "shape", "group")} for m in _param_meta(opt)],
            "master": masters, "state": states, "scalars": scalars,
            "skipped_steps": opt.skipped_steps,
            "loss_scaler": opt.loss_scaler.state_dict() if opt.loss_scaler else None}


def _fill(reader: Reader, master: torch.Tensor, pieces: list[tuple[str, int, int, int]],
          key_name: str) -> dict:
    """Fill ``master`` and rebuild its optimizer state from (name, e0, e1, offset) pieces."""
    keys, other = reader.keys(key_name)
    state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in other.items()}
    elem = {k: torch.zeros_like(master) for k in keys}
    master.zero_()
    for name, e0, e1, off in pieces:
        if e1 <= e0:  # this rank owns no element of the parameter (numel < world size)
            continue
        master.narrow(0, off, e1 - e0).copy_(reader.read(name, None, e0, e1))
        for k in keys:
            elem[k].narrow(0, off, e1 - e0).copy_(reader.read(name, k, e0, e1))
    state.update(elem)
    return state


def _model_shapes(opt: Masters) -> dict[str, Sequence[int]]:
    """Name -> shape of every parameter ``opt`` manages."""
    out: dict[str, Sequence[int]] = {}
    for g, fg in enumerate(opt.flat_groups):
        if fg is not None:
            out.update((name, p.shape) for p, name in zip(fg.params, fg.names))
        out.update((s.name, s.shape) for s in opt.sharded_groups[g])
    return out


def _pieces(opt: Masters) -> list[tuple[str, int, int]]:
    """``(name, e0, e1)``: the elements of every parameter this rank's masters hold."""
    out = []
    for g, fg in enumerate(opt.flat_groups):
        if fg is not None:
            out += [(fg.names[pc.index], pc.start, pc.stop) for pc in fg.layout.pieces(opt.rank)]
        out += [(s.name, *s.layout.range(opt.rank)) for s in opt.sharded_groups[g]]
    return out


def _group_names(opt: Masters) -> list[list[str]]:
    """The parameter names of each of ``opt``'s param groups."""
    return [(fg.names if fg is not None else []) + [s.name for s in opt.sharded_groups[g]]
            for g, fg in enumerate(opt.flat_groups)]


def _plan(opt: Masters, source: Optional[Source], strict: bool) -> tuple[Reader, list]:
    """Every check of a load, before anything changes: the reader and each group's settings."""
    reader = Reader(source)
    reader.check(_model_shapes(opt), strict)
    reader.check_sources(_pieces(opt))
    saved_group = {name: m["group"] for name, m in reader.meta.items()}
    return reader, group_options(reader.first["param_groups"], saved_group, _group_names(opt))


def load(opt: Masters, source: Optional[Source], strict: bool = True) -> None:
    """Load a consolidated dict, or saved rank dicts (all, or at least those this rank's new
    partition overlaps; at an unchanged world size, this rank's own), into ``opt``.

    Everything is checked first on every rank (names, shapes, dtypes, the saved ranks this
    rank needs, group settings; with ``strict`` also saved parameters the model lacks) and the
    verdicts agreed across ranks, so a bad checkpoint raises on every rank before ``opt``
    changes. Group settings (lr, ...) follow the parameters by name, whatever the group order."""
    reader, options = agree(lambda: _plan(opt, source, strict), opt.comm,
                            "BF16Optimizer.load_state_dict")
    for g, fg in enumerate(opt.flat_groups):
        if fg is not None:
            pieces = [(fg.names[pc.index], pc.start, pc.stop, pc.offset)
                      for pc in fg.layout.pieces(opt.rank)]
            set_flat_state(opt.optimizer, fg, _fill(reader, fg.master, pieces, fg.names[0]))
        for s in opt.sharded_groups[g]:
            _load_sharded(opt, reader, s)
    for group, opts in zip(opt.optimizer.param_groups, options):
        if opts is not None:
            group.update(opts)
    opt.skipped_steps = reader.first["skipped_steps"]
    if opt.loss_scaler is not None and reader.first["loss_scaler"] is not None:
        opt.loss_scaler.load_state_dict(reader.first["loss_scaler"])
    opt.write_back()


def _load_sharded(opt: Masters, reader: Reader, s: ShardedParam) -> None:
    """Fill one sharded param's master and state from ``reader``, one tensor at a time (an
    offloaded master and its state go to the store, its model-dtype shard is written there)."""
    keys, other = reader.keys(s.name)
    inner_state.replace(opt.optimizer, s.master, {k: (v.clone() if torch.is_tensor(v) else v)
                                                  for k, v in other.items()})
    s.set_master(_saved_shard(reader, s, None, opt.rank))
    for k in keys:
        inner_state.put(opt.optimizer, s.master, k, _saved_shard(reader, s, k, opt.rank))


def _saved_shard(reader: Reader, s: ShardedParam, key: Optional[str], rank: int) -> torch.Tensor:
    """``rank``'s shard of ``s``'s saved master (``key`` None) or state ``key``: zero padding, fp32."""
    start, stop = s.layout.range(rank)
    out = torch.zeros(s.master.shape, dtype=s.master.dtype, device=s.master.device)
    if stop > start:  # (a rank may own no element of a parameter with numel < world size)
        out.narrow(0, 0, stop - start).copy_(reader.read(s.name, key, start, stop))
    return out


def full_param_tensor(opt: Masters, p: torch.Tensor, key: Optional[str]) -> StateValue:
    """Full fp32 master (``key`` None) or state ``key`` of ``p`` gathered across ranks."""
    opt.sync_masters()
    kind, g, i = opt.locate(p)
    if kind == "flat":
        fg = opt.flat_groups[g]
        value = fg.master if key is None else flat_state(opt.optimizer, fg).get(key)
    else:
        s = opt.sharded_groups[g][i]
        if key is None or key in inner_state.keys(opt.optimizer, s.master):
            return _full_sharded(opt, s, key)
        value = inner_state.scalars(opt.optimizer, s.master).get(key)
    if value is None:
        raise KeyError(f"no optimizer state {key!r} for this parameter (before the first step?)")
    if kind != "flat" or not _is_elementwise(value, fg.master):
        return value
    full = C.all_gather_partition(value.reshape(-1), opt.comm)
    return full.narrow(0, fg.layout.offsets[i], _numel(p.shape)).view(p.shape).clone()


def full_grad_tensor(opt: Masters, p: torch.Tensor) -> torch.Tensor:
    """Full grad of ``p`` averaged across ranks (a collective)."""
    kind, g, i = opt.locate(p)
    if kind == "flat":
        view = opt.flat_groups[g].grad_view(i)
        return C.all_reduce_mean(view, opt.comm)
    s = opt.sharded_groups[g][i]
    grad = s.any_grad()  # (a shard on disk has its grad in the store)
    local = grad if grad is not None else torch.zeros(s.master.shape, dtype=torch.float32, device=s.master.device)
    full = C.all_gather_partition(local, opt.comm)
    return full.narrow(0, 0, s.numel).view(s.shape).clone()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _adopted(value: Any, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() >= 1 and value.numel() == numel


def adopt_flat_state(inner: torch.optim.Optimizer, fg: FlatGroup, states: list[dict]) -> None:
    """Re-slice per-parameter state (from before wrapping) onto ``fg``'s master partition."""
    index, first = next((i, st) for i, st in enumerate(states) if st)
    state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in first.items()
             if not _adopted(v, fg.params[index].numel())}
    for key in [k for k in first if k not in state]:
        buf = torch.zeros_like(fg.master)
        for pc in fg.layout.pieces(fg.rank):
            src = states[pc.index][key].reshape(-1)[pc.start:pc.stop]
            buf.narrow(0, pc.offset, pc.stop - pc.start).copy_(src)
        state[key] = buf
    set_flat_state(inner, fg, state)


def adopt_sharded_state(inner: torch.optim.Optimizer, s: ShardedParam, old: dict) -> None:
    """Move a sharded parameter's pre-wrapping state onto its master (full or shard-shaped)."""
    start, stop = s.layout.range(s.rank)
    state = {}
    for key, v in old.items():
        if _adopted(v, s.numel):
            buf = torch.zeros_like(s.master)
            buf.narrow(0, 0, stop - start).copy_(v.reshape(-1)[start:stop])
            state[key] = buf
        elif _adopted(v, s.master.numel()):
            state[key] = v.reshape(-1).to(torch.float32).clone()
        else:
            state[key] = v.clone() if torch.is_tensor(v) else v
    inner.state[s.master] = state
