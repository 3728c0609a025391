"""BF16Optimizer state for ``torch.distributed.checkpoint`` (DCP): views, at any world size.

``{"state": {fqn: {key: ...}}, "param_groups": [{..., "params": [fqn...]}], "master":
{fqn: ...}, "skipped_steps": n, "loss_scaler": {...} or None}``: the keys of torch's
``get_optimizer_state_dict`` plus the fp32 masters. Every per-element tensor (master,
``exp_avg``...) is a ``parts.comm.dcp.ShardView`` of the parameter's global shape over the
elements this rank holds: its pieces of the flat groups' master partition (split at the
step chunks the wrapped optimizer sees) and its shard of sharded parameters. Views of the
tensors the optimizer steps: saving copies nothing, loading writes straight into them;
``load_sharded_state_dict`` then writes the masters back into the model (all-gathers).
Over shards on disk (``BF16Optimizer(OffloadedOptimizer(...))``) the masters and the state
tensors in the store are deferred segments (``parts.offload.lease.Stored``, seen through
``stored_state`` and ``parts.partition.core.disk``): read when DCP saves them, written there
when DCP loads them, one at a time.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from parts.base.wrapper import init_state
from parts.comm.dcp import ShardView, is_deferred, same_piece, settle
from parts.partition.core import disk

from .flat_group import FlatGroup
from .masters import Masters
from .sharded import ShardedParam


def _fqn_of(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _chunk_segments(fg: FlatGroup, pc: Any, tensors: list[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """``(flat start in the parameter, view)`` of piece ``pc`` split over the step chunks' ``tensors``."""
    out, n = [], pc.stop - pc.start
    for (cs, cl), t in zip(fg.chunks, tensors):
        lo, hi = max(pc.offset, cs), min(pc.offset + n, cs + cl)
        if lo < hi:
            out.append((pc.start + lo - pc.offset, t.reshape(-1).narrow(0, lo - cs, hi - lo)))
    return out


def _elementwise(value: Any, like: Any) -> bool:
    """A per-element state tensor (in memory or stored) of ``like``'s size."""
    return (torch.is_tensor(value) or is_deferred(value)) and value.dim() >= 1 and value.numel() == like.numel()


def _state_of(inner: torch.optim.Optimizer, target: torch.Tensor) -> dict:
    """The wrapped optimizer's state of ``target``; an ``OffloadedOptimizer``'s stored tensors as ``Stored``."""
    stored = getattr(inner, "stored_state", None)
    return stored(target) if stored is not None else inner.state.get(target, {})


def _master(s: ShardedParam) -> Any:
    """A sharded param's fp32 master: the tensor, or (offloaded) its ``Stored`` bytes."""
    stored = disk.stored(s.master)
    return s.master if stored is None else stored


def _entries(opt: Masters, fqn: dict[int, str]) -> list[tuple[str, torch.Size, list, list, dict, int]]:
    """Per parameter: (FQN, shape, master segments, per-key state tensors list, scalars, group)."""
    inner, out = opt.optimizer, []
    for g, fg in enumerate(opt.flat_groups):
        if fg is not None:
            states = [_state_of(inner, c) for c in fg.master_chunks]
            first = states[0] if states else {}
            keys = [k for k, v in first.items() if _elementwise(v, fg.master_chunks[0])]
            scalars = {k: v for k, v in first.items() if k not in keys}
            pieces = {pc.index: pc for pc in fg.layout.pieces(opt.rank)}
            for i, p in enumerate(fg.params):
                pc = pieces.get(i)
                master = _chunk_segments(fg, pc, fg.master_chunks) if pc else []
                state = {k: (_chunk_segments(fg, pc, [st[k] for st in states]) if pc else []) for k in keys}
                out.append((fqn.get(id(p), fg.names[i]), p.shape, master, state, scalars, g))
        for s in opt.sharded_groups[g]:
            start, real = s.layout.range(opt.rank)[0], s.real_numel()
            st = _state_of(inner, s.master)
            keys = [k for k, v in st.items() if _elementwise(v, s.master)]
            state = {k: [(start, st[k].reshape(-1).narrow(0, 0, real))] for k in keys}
            out.append((fqn.get(id(s.param), s.name), torch.Size(s.shape),
                        [(start, _master(s).narrow(0, 0, real))], state,
                        {k: v for k, v in st.items() if k not in keys}, g))
    return out


def _view(shape: torch.Size, segments: list, name: str) -> ShardView:
    return ShardView(shape, segments, dtype=torch.float32, device=segments[0][1].device if segments else None,
                     name=name)


def sharded_state_dict(opt: Masters, model: nn.Module) -> dict[str, Any]:
    """``opt``'s state as DCP views keyed by the model's FQNs (see the module docstring)."""
    opt.sync_masters()
    init_state(opt.optimizer)  # a checkpoint before the first step holds the state it will have
    return _views(opt, model)


def _views(opt: Masters, model: nn.Module) -> dict[str, Any]:
    """The views of ``opt``'s masters and state as they are now."""
    state, master, names = {}, {}, [[] for _ in opt.optimizer.param_groups]
    for name, shape, segs, per_key, scalars, g in _entries(opt, _fqn_of(model)):
        master[name] = _view(shape, segs, f"master.{name}")
        state[name] = {**{k: _view(shape, v, f"{name}.{k}") for k, v in per_key.items()}, **scalars}
        names[g].append(name)
    groups = [{**{k: v for k, v in grp.items() if k != "params"}, "params": names[g]}
              for g, grp in enumerate(opt.optimizer.param_groups)]
    return {"state": state, "param_groups": groups, "master": master, "skipped_steps": opt.skipped_steps,
            "loss_scaler": opt.loss_scaler.state_dict() if opt.loss_scaler else None}


def _install_scalars(opt: Masters, state: Mapping[str, Any], fqn: dict[int, str]) -> None:
    """Loaded replicated entries (``step``...) of each parameter onto every state dict holding them."""
    inner = opt.optimizer
    for name, shape, segs, per_key, scalars, g in _entries(opt, fqn):
        loaded = state["state"].get(name, {})
        for k in scalars:
            if k not in loaded:
                continue
            for target in _holders(opt, g, name, fqn):
                value = loaded[k]
                old = inner.state[target].get(k)
                if torch.is_tensor(old) and torch.is_tensor(value):
                    if old is not value:
                        old.copy_(value)
                else:
                    inner.state[target][k] = value


def _holders(opt: Masters, g: int, name: str, fqn: dict[int, str]) -> list[torch.Tensor]:
    """The wrapped optimizer's tensors whose state holds ``name``'s scalars (a flat group: every chunk)."""
    fg = opt.flat_groups[g]
    if fg is not None and name in {fqn.get(id(p), n) for p, n in zip(fg.params, fg.names)}:
        return list(fg.master_chunks)
    return [s.master for s in opt.sharded_groups[g] if fqn.get(id(s.param), s.name) == name]


def load_sharded_state_dict(opt: Masters, model: nn.Module, state: Mapping[str, Any]) -> None:
    """Install what ``dcp.load`` filled into ``sharded_state_dict(opt, model)``; masters written back."""
    if not isinstance(state, Mapping) or not {"state", "param_groups", "master"} <= set(state):
        raise ValueError("BF16Optimizer.load_sharded_state_dict: state must be the dict its sharded_state_dict "
                         "returned, filled by dcp.load (keys 'state', 'param_groups', 'master')")
    settle(dict(state))  # what DCP wrote into stored masters and state goes to their store
    fqn = _fqn_of(model)
    # no sync_masters: loaded masters beat shards loaded just before; the views of our own
    # tensors: loaded values copied in if not them
    ours = _views(opt, model)
    for name, view in ours["master"].items():
        _copy_view(view, state["master"].get(name), f"master.{name}")
        for k, v in ours["state"][name].items():
            if isinstance(v, ShardView):
                _copy_view(v, state["state"].get(name, {}).get(k), f"{name}.{k}")
    _install_scalars(opt, state, fqn)
    saved = {frozenset(g["params"]): g for g in state["param_groups"]}
    for n, (group, mine) in enumerate(zip(opt.optimizer.param_groups, ours["param_groups"])):
        match = saved.get(frozenset(mine["params"]))
        if match is None:
            raise ValueError(f"BF16Optimizer.load_sharded_state_dict: group {n} ({mine['params']}) matches no "
                             f"saved group")
        group.update({k: v for k, v in match.items() if k != "params"})
    opt.skipped_steps = int(state.get("skipped_steps", opt.skipped_steps))
    if opt.loss_scaler is not None and state.get("loss_scaler") is not None:
        opt.loss_scaler.load_state_dict(state["loss_scaler"])
    settle(ours)
    opt.write_back()
    for sharded in (sp for group in opt.sharded_groups for sp in group if sp.offloaded):
        sharded.write_back()  # write_back leaves offloaded masters to the step's pipeline: done here


def _copy_view(dst: ShardView, src: Any, name: str) -> None:
    """Copy the loaded ``src`` into our view ``dst`` unless it is ``dst``'s own memory."""
    if not isinstance(src, ShardView):
        raise ValueError(f"BF16Optimizer.load_sharded_state_dict: '{name}' is missing or not a ShardView")
    if [(s, t.numel()) for s, t in dst.segments] != [(s, t.numel()) for s, t in src.segments]:
        raise ValueError(f"BF16Optimizer.load_sharded_state_dict: '{name}' holds other pieces than this "
                         f"optimizer does on this rank: pass what sharded_optimizer_state_dict returned")
    for (_, seg), (_, other) in zip(dst.segments, src.segments):
        if seg.numel() == 0 or same_piece(seg, other):
            continue
        values = other.materialize() if is_deferred(other) else other
        with torch.no_grad():
            (seg.materialize() if is_deferred(seg) else seg).copy_(values)
