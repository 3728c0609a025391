"""BF16Optimizer state dicts: per-rank dicts that re-slice at any world size, and a consolidated form.

A rank's dict holds, per group, the real (unpadded) elements of its fp32 master
partition and of every per-element optimizer state tensor, plus per-parameter
metadata (name, shape, group, flat offset or shard layout). Loading maps each
parameter piece this rank now owns back to the saved ranks that held it
(``layout.source_ranges``), so 2->3 or 4->2 needs no offline conversion. Only
tensors, numbers, strings, lists, tuples and dicts: ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from parts.comm import agree

from . import _collectives as C
from .layout import source_ranges
from .load_checks import check_dtypes, check_names, group_options

if TYPE_CHECKING:  # the optimizer imports this module
    from .bf16_optimizer import BF16Optimizer
    from .flat_group import FlatGroup
    from .sharded import ShardedParam

__all__ = ["rank_state_dict", "consolidated_state_dict", "load", "full_param_tensor",
           "full_grad_tensor", "flat_state", "set_flat_state"]

FORMAT = "parts.optim.BF16Optimizer/1"


def _is_elementwise(value: Any, master: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() >= 1 and value.numel() == master.numel()


def flat_state(inner: torch.optim.Optimizer, fg: "FlatGroup") -> dict:
    """The wrapped optimizer's state of ``fg``'s master chunks, merged into partition-sized tensors."""
    states = [inner.state.get(c, {}) for c in fg.master_chunks]
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


def set_flat_state(inner: torch.optim.Optimizer, fg: "FlatGroup", state: dict) -> None:
    """Split partition-sized ``state`` over ``fg``'s master chunks (each gets its own scalars)."""
    for chunk, (start, length) in zip(fg.master_chunks, fg.chunks):
        inner.state.pop(chunk, None)
        if state:
            inner.state[chunk] = {
                k: (v.reshape(-1).narrow(0, start, length).clone() if _is_elementwise(v, fg.master)
                    else (v.clone() if torch.is_tensor(v) else v)) for k, v in state.items()}


def _split_state(state: dict, master: torch.Tensor, real: int) -> tuple[dict, dict]:
    """(per-element state as real-element slices, everything else) of one master tensor."""
    elem, other = {}, {}
    for key, value in state.items():
        if _is_elementwise(value, master):
            elem[key] = value.reshape(-1).narrow(0, 0, real).clone()
        else:
            other[key] = value.clone() if torch.is_tensor(value) else value
    return elem, other


def _options(opt: "BF16Optimizer") -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]


def _param_meta(opt: "BF16Optimizer") -> list[dict]:
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


def rank_state_dict(opt: "BF16Optimizer") -> dict:
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
    sharded = [[_record(s.master, opt.optimizer.state.get(s.master, {}), s.real_numel(),
                        s.layout.range(opt.rank)[0]) for s in sh] for sh in opt.sharded_groups]
    return {"format": FORMAT, "kind": "rank", "world_size": opt.world_size, "rank": opt.rank,
            "param_groups": _options(opt), "params": _param_meta(opt), "groups": groups,
            "sharded": sharded, "skipped_steps": opt.skipped_steps,
            "loss_scaler": opt.loss_scaler.state_dict() if opt.loss_scaler else None}


def _gather_full(opt: "BF16Optimizer", master: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
    full = C.all_gather_partition(master, opt.comm)
    elem = {k: C.all_gather_partition(v.reshape(-1), opt.comm)
            for k, v in state.items() if _is_elementwise(v, master)}
    return full, elem


def consolidated_state_dict(opt: "BF16Optimizer") -> Optional[dict]:
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
            state = opt.optimizer.state.get(s.master, {})
            full, elem = _gather_full(opt, s.master, state)
            add(s.name, list(s.shape), full, elem, 0, _split_state(state, s.master, 0)[1])
    if not keep:
        return None
    return {"format": FORMAT, "kind": "consolidated", "param_groups": _options(opt),
            "params": [{k: m[k] for k in ("name", "shape", "group")} for m in _param_meta(opt)],
            "master": masters, "state": states, "scalars": scalars,
            "skipped_steps": opt.skipped_steps,
            "loss_scaler": opt.loss_scaler.state_dict() if opt.loss_scaler else None}


class _Reader:
    """Reads elements ``[e0, e1)`` of one saved parameter's flat master or state."""

    def __init__(self, source: Any) -> None:
        if source is None:
            raise ValueError("BF16Optimizer.load_state_dict got None on this rank: "
                             "consolidated_state_dict() returns None on every rank but 0 (it gathers "
                             "to rank 0); pass the same consolidated dict on every rank (save it on "
                             "rank 0, load the file on every rank), or every saved rank's state_dict()")
        sds = list(source) if isinstance(source, (list, tuple)) else [source]
        for sd in sds:
            if not isinstance(sd, dict) or sd.get("format") != FORMAT:
                raise ValueError("BF16Optimizer.load_state_dict expects BF16Optimizer.state_dict() "
                                 "output (a list of every rank's) or consolidated_state_dict()")
        self.first = sds[0]
        self.consolidated = self.first["kind"] == "consolidated"
        self.sds = {d.get("rank", 0): d for d in sds}  # only the saved ranks this rank reads
        self.meta = {m["name"]: m for m in self.first["params"]}

    def check(self, model: dict[str, Sequence[int]], strict: bool) -> None:
        """Raise before loading if names, shapes or dtypes do not fit ``model`` (name -> shape)."""
        check_names({n: m["shape"] for n, m in self.meta.items()}, model, strict)
        check_dtypes(self.sds.values())

    def _span(self, name: str) -> tuple[int, int]:
        """(offset of ``name`` in its saved partition space, saved partition size)."""
        m = self.meta[name]
        if m["kind"] == "flat":
            return m["offset"], self.first["groups"][m["group"]]["partition_numel"]
        return 0, m["shard_numel"]

    def check_sources(self, pieces: Sequence[tuple[str, int, int]]) -> None:
        """Raise naming the saved ranks whose dicts the ``(name, e0, e1)`` pieces need and lack."""
        if self.consolidated:
            return
        need = set()
        for name, e0, e1 in pieces:
            if e1 > e0:
                base, size = self._span(name)
                need.update(rank for rank, _, _ in source_ranges(base + e0, base + e1, size))
        lacking = sorted(need - set(self.sds))
        if lacking:
            plural = "s" if len(lacking) > 1 else ""
            raise ValueError(f"BF16Optimizer.load_state_dict: this rank's partition needs the state "
                             f"dict{plural} of saved rank{plural} {', '.join(map(str, lacking))} of "
                             f"{self.first['world_size']}; got saved ranks {sorted(self.sds)}. Pass "
                             f"the list of every saved rank's state_dict() on every rank")

    def _record(self, name: str, rank: int) -> dict:
        if rank not in self.sds:
            raise ValueError(f"loading parameter {name!r} needs the state dict of saved rank "
                             f"{rank} of {self.first['world_size']}; got ranks {sorted(self.sds)}")
        m = self.meta[name]
        if m["kind"] == "flat":
            return self.sds[rank]["groups"][m["group"]]
        return self.sds[rank]["sharded"][m["group"]][m["slot"]]

    def read(self, name: str, key: Optional[str], e0: int, e1: int) -> torch.Tensor:
        """Elements ``[e0, e1)`` of the master (``key`` None) or state ``key`` of ``name``."""
        if self.consolidated:
            src = self.first["master"][name] if key is None else self.first["state"][name][key]
            return src.reshape(-1)[e0:e1]
        base, size = self._span(name)
        parts = []
        for rank, lo, hi in source_ranges(base + e0, base + e1, size):
            rec = self._record(name, rank)
            parts.append((rec["master"] if key is None else rec["state"][key])[lo:hi])
        return torch.cat(parts) if len(parts) != 1 else parts[0]

    def keys(self, name: str) -> tuple[list[str], dict]:
        """(per-element state keys, other state) saved for ``name``."""
        if self.consolidated:
            return list(self.first["state"][name]), self.first["scalars"][name]
        rec = self._record(name, self.first["rank"])
        return list(rec["state"]), rec["scalars"]


def _fill(reader: _Reader, master: torch.Tensor, pieces: list[tuple[str, int, int, int]],
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


def _model_shapes(opt: "BF16Optimizer") -> dict[str, Sequence[int]]:
    """Name -> shape of every parameter ``opt`` manages."""
    out: dict[str, Sequence[int]] = {}
    for g, fg in enumerate(opt.flat_groups):
        if fg is not None:
            out.update((name, p.shape) for p, name in zip(fg.params, fg.names))
        out.update((s.name, s.shape) for s in opt.sharded_groups[g])
    return out


def _pieces(opt: Any) -> list[tuple[str, int, int]]:
    """``(name, e0, e1)``: the elements of every parameter this rank's masters hold."""
    out = []
    for g, fg in enumerate(opt.flat_groups):
        if fg is not None:
            out += [(fg.names[pc.index], pc.start, pc.stop) for pc in fg.layout.pieces(opt.rank)]
        out += [(s.name, *s.layout.range(opt.rank)) for s in opt.sharded_groups[g]]
    return out


def _group_names(opt: Any) -> list[list[str]]:
    """The parameter names of each of ``opt``'s param groups."""
    return [(fg.names if fg is not None else []) + [s.name for s in opt.sharded_groups[g]]
            for g, fg in enumerate(opt.flat_groups)]


def _plan(opt: Any, source: Any, strict: bool) -> tuple[_Reader, list]:
    """Every check of a load, before anything changes: the reader and each group's settings."""
    reader = _Reader(source)
    reader.check(_model_shapes(opt), strict)
    reader.check_sources(_pieces(opt))
    saved_group = {name: m["group"] for name, m in reader.meta.items()}
    return reader, group_options(reader.first["param_groups"], saved_group, _group_names(opt))


def load(opt: "BF16Optimizer", source: Any, strict: bool = True) -> None:
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
            start, stop = s.layout.range(opt.rank)
            _set_state(opt, s.master, _fill(reader, s.master, [(s.name, start, stop, 0)], s.name))
    for group, opts in zip(opt.optimizer.param_groups, options):
        if opts is not None:
            group.update(opts)
    opt.skipped_steps = reader.first["skipped_steps"]
    if opt.loss_scaler is not None and reader.first["loss_scaler"] is not None:
        opt.loss_scaler.load_state_dict(reader.first["loss_scaler"])
    opt.write_back()


def _set_state(opt: "BF16Optimizer", master: torch.Tensor, state: dict) -> None:
    opt.optimizer.state.pop(master, None)
    if state:
        opt.optimizer.state[master] = state


def full_param_tensor(opt: "BF16Optimizer", p: torch.Tensor, key: Optional[str]) -> Any:
    """Full fp32 master (``key`` None) or state ``key`` of ``p`` gathered across ranks."""
    opt.sync_masters()
    kind, g, i = opt.locate(p)
    if kind == "flat":
        fg = opt.flat_groups[g]
        master, off, shape = fg.master, fg.layout.offsets[i], p.shape
        state = flat_state(opt.optimizer, fg)
    else:
        s = opt.sharded_groups[g][i]
        master, off, shape = s.master, 0, s.shape
        state = opt.optimizer.state.get(master, {})
    value = master if key is None else state.get(key)
    if value is None:
        raise KeyError(f"no optimizer state {key!r} for this parameter (before the first step?)")
    if not _is_elementwise(value, master):
        return value
    full = C.all_gather_partition(value.reshape(-1), opt.comm)
    return full.narrow(0, off, _numel(shape)).view(shape).clone()


def full_grad_tensor(opt: "BF16Optimizer", p: torch.Tensor) -> torch.Tensor:
    """Full grad of ``p`` averaged across ranks (a collective)."""
    kind, g, i = opt.locate(p)
    if kind == "flat":
        view = opt.flat_groups[g].grad_view(i)
        return C.all_reduce_mean(view, opt.comm)
    s = opt.sharded_groups[g][i]
    grad = s.grad()
    local = grad if grad is not None else torch.zeros_like(s.master)
    full = C.all_gather_partition(local, opt.comm)
    return full.narrow(0, 0, s.numel).view(s.shape).clone()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _adopted(value: Any, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() >= 1 and value.numel() == numel


def adopt_flat_state(inner: torch.optim.Optimizer, fg: "FlatGroup", states: list[dict]) -> None:
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


def adopt_sharded_state(inner: torch.optim.Optimizer, s: "ShardedParam", old: dict) -> None:
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
