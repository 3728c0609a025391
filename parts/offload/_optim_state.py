"""The state of ``OffloadedOptimizer`` read and written one tensor at a time: ``state_of``,
``write_state``, the state dicts (whole, or with each stored tensor deferred as a ``Stored``
for a DCP checkpoint) and their load, which streams tensors to the store.

A mixin of ``OffloadedOptimizer``: it uses the optimizer's ``optimizer``, ``store``,
``_params``, ``_index``, ``_placed`` and ``_key`` and its ``settle`` before any change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from parts.offload import parking
from parts.offload.lease import Stored


@dataclass
class Snapshot:
    """What a step during backward changes of one parameter outside the store, kept until it
    commits: its small in-memory state entries and the names of its state tensors in the store
    (None: it had none)."""

    state: Optional[dict[str, Any]]
    placed: Optional[dict[str, tuple[torch.Size, torch.dtype]]]


class StateAccess:
    """``OffloadedOptimizer``'s per-tensor state access and state dicts (see the module docstring)."""

    def state_of(self, p: torch.Tensor) -> dict[str, Any]:
        """The full state of ``p`` (offloaded tensors read back into fresh memory)."""
        self.settle()
        state = dict(self.optimizer.state.get(p, {}))
        state.update((name, self.state_of_key(p, name)) for name in self.stored_keys(p))
        return state

    # ------------------------------------------- one state tensor at a time (checkpoints)
    def stored_keys(self, p: torch.Tensor) -> list[str]:
        """Names of ``p``'s state tensors that live in the store."""
        return list(self._placed.get(id(p), {}))

    def write_state(self, p: torch.Tensor, name: str, value: torch.Tensor) -> None:
        """Store ``value`` (shaped like ``p``, on CPU) as ``p``'s state tensor ``name``; waits."""
        if value.shape != p.shape or value.device.type != "cpu":
            raise ValueError(f"OffloadedOptimizer: state {name!r} of parameter "
                             f"{self._index.get(id(p), '?')} must be a CPU tensor of shape "
                             f"{tuple(p.shape)}, got {tuple(value.shape)} on {value.device}")
        self.settle()
        self.optimizer.state.get(p, {}).pop(name, None)
        self.store.write(self._key(p, name), value.contiguous()).wait()
        self._placed.setdefault(id(p), {})[name] = (value.shape, value.dtype)

    def clear_state(self, p: torch.Tensor) -> None:
        """Forget ``p``'s state: the in-memory entries and the stored tensors."""
        self.settle()
        self.optimizer.state.pop(p, None)
        for name in self._placed.pop(id(p), {}):
            self.store.delete(self._key(p, name))

    # ------------------------------------------------------------------- state dicts
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's ``state_dict()`` with the offloaded tensors read back in."""
        return self._state_dict(lambda p, name, stored: self.state_of_key(p, name))

    def stored_state_dict(self) -> dict[str, Any]:
        """``state_dict()`` with each offloaded tensor as a ``parts.offload.lease.Stored`` (nothing
        read: a DCP checkpoint reads them one at a time); ``load_state_dict`` takes it back."""
        return self._state_dict(lambda p, name, stored: stored)

    def stored_state(self, p: torch.Tensor) -> dict[str, Any]:
        """The state of ``p``: in-memory entries, and offloaded tensors as ``Stored`` (nothing read)."""
        return {**self.optimizer.state.get(p, {}), **self._stored(p)}

    def _stored(self, p: torch.Tensor) -> dict[str, Stored]:
        return {name: Stored(self.store, self._key(p, name), shape.numel(), dtype)
                for name, (shape, dtype) in self._placed.get(id(p), {}).items()}

    def state_of_key(self, p: torch.Tensor, name: str) -> torch.Tensor:
        """Offloaded state tensor ``name`` of ``p``, read into fresh memory."""
        shape, dtype = self._placed[id(p)][name]
        out = parking.empty_for_io(shape, dtype)
        self.store.read(self._key(p, name), out).wait()
        return out

    def _state_dict(self, offloaded: Callable[[torch.Tensor, str, Stored], Any]) -> dict[str, Any]:
        self.settle()
        sd = self.optimizer.state_dict()
        for p in self._params:
            stored = self._stored(p)
            if stored:
                entry = sd["state"].setdefault(self._index[id(p)], {})
                entry.update({name: offloaded(p, name, st) for name, st in stored.items()})
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load as the wrapped optimizer does; state tensors shaped like their parameter go straight
        to the store one at a time (never all in memory at once); a ``Stored`` entry (from
        ``stored_state_dict``) must name this optimizer's own key: its bytes stay."""
        self.settle()
        state_dict, kept = self._take_stored(state_dict)
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        by_id = dict(zip(saved, self._params)) if len(saved) == len(self._params) else {}
        streamed = {i: {k: v for k, v in st.items() if k != "step" and _shaped_like(v, by_id[i])}
                    for i, st in state_dict["state"].items() if i in by_id}
        rest = dict(state_dict, state={i: {k: v for k, v in st.items() if k not in streamed.get(i, {})}
                                       for i, st in state_dict["state"].items()})
        self.optimizer.load_state_dict(rest)  # checks the groups; raises before anything changed
        for i, p in enumerate(self._params):
            for name in self._placed.pop(id(p), {}):
                if name not in kept.get(i, {}):
                    self.store.delete(self._key(p, name))
        for i, names in kept.items():
            self._placed.setdefault(id(self._params[i]), {}).update(names)
        for i, tensors in streamed.items():
            p = by_id[i]
            for name, value in tensors.items():  # cast as torch casts non-step state
                dtype = p.dtype if p.is_floating_point() else value.dtype
                self.write_state(p, name, value.to(device=p.device, dtype=dtype))
        self._offload_all()  # anything else shaped like its parameter (e.g. a 0-d param's step)

    def _take_stored(self, state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[int, dict]]:
        """``state_dict`` without its ``Stored`` entries (checked to be this optimizer's own), and
        ``{index: {name: (shape, dtype)}}`` of those entries."""
        kept: dict[int, dict[str, tuple[torch.Size, torch.dtype]]] = {}
        state = {i: dict(entry) for i, entry in state_dict.get("state", {}).items()}
        for i, entry in state.items():
            for name, value in list(entry.items()):
                if not isinstance(value, Stored):
                    continue
                placed = self._placed.get(id(self._params[i]), {}).get(name) if i < len(self._params) else None
                if placed is None or value.store is not self.store or value.key != self._key(self._params[i], name):
                    raise ValueError(f"OffloadedOptimizer.load_state_dict: state {name!r} of tensor #{i} is "
                                     f"{value!r}, not this optimizer's own stored tensor")
                kept.setdefault(i, {})[name] = placed
                del entry[name]
        return {**state_dict, "state": state}, kept


def _shaped_like(value: Any, p: torch.Tensor) -> bool:
    """A tensor the store holds for ``p``: shaped like it (its device is the parameter's)."""
    return isinstance(value, torch.Tensor) and value.shape == p.shape
