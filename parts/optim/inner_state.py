"""The wrapped optimizer's state of one master tensor, wherever it lives, one tensor at a time.

A plain torch optimizer keeps ``state[p]`` in memory. An ``OffloadedOptimizer`` (an
optimizer that ``drives_parked_tensors``) keeps only small entries there (Adam's ``step``)
and its per-element tensors in its ``DiskStore``, reachable through ``stored_keys``,
``state_of_key``, ``write_state`` and ``clear_state``. ``BF16Optimizer``'s checkpoint code goes
through these functions, so with offloaded state it reads or writes one state tensor at a
time and never holds a whole parameter's state (let alone the model's) beyond its result.
"""

from __future__ import annotations

from typing import Any

import torch

from parts.partition.core import disk


def is_elementwise(value: Any, master: torch.Tensor) -> bool:
    """True for a state tensor with one element per element of ``master`` (``exp_avg``...)."""
    return torch.is_tensor(value) and value.dim() >= 1 and value.numel() == master.numel()


def _stored(inner: torch.optim.Optimizer) -> bool:
    return disk.drives_parked(inner)


def keys(inner: torch.optim.Optimizer, p: torch.Tensor) -> list[str]:
    """Names of ``p``'s per-element state tensors, in memory or in the store."""
    names = [k for k, v in inner.state.get(p, {}).items() if is_elementwise(v, p)]
    return names + ([k for k in inner.stored_keys(p) if k not in names] if _stored(inner) else [])


def scalars(inner: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """``p``'s state entries that are not per-element (step counters...), as held."""
    return {k: v for k, v in inner.state.get(p, {}).items() if not is_elementwise(v, p)}


def tensor(inner: torch.optim.Optimizer, p: torch.Tensor, key: str) -> torch.Tensor:
    """State ``key`` of ``p``: the tensor itself if in memory, else a fresh copy read from the store."""
    held = inner.state.get(p, {})
    if key in held:
        return held[key]
    if _stored(inner):
        return inner.state_of_key(p, key)
    raise KeyError(f"no optimizer state {key!r} for this parameter (before the first step?)")


def full(inner: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """All of ``p``'s state (stored tensors read into fresh memory)."""
    return inner.state_of(p) if _stored(inner) else inner.state.get(p, {})


def replace(inner: torch.optim.Optimizer, p: torch.Tensor, state: dict) -> None:
    """Make ``state`` all of ``p``'s state; with a store, its per-element tensors go there."""
    if _stored(inner):
        inner.clear_state(p)
    else:
        inner.state.pop(p, None)
    if state:
        inner.state[p] = {k: v for k, v in state.items() if not (_stored(inner) and is_elementwise(v, p))}
    for k, v in state.items():
        if _stored(inner) and is_elementwise(v, p):
            inner.write_state(p, k, v.reshape(p.shape))


def put(inner: torch.optim.Optimizer, p: torch.Tensor, key: str, value: torch.Tensor) -> None:
    """Set one per-element state tensor of ``p`` (to the store if the optimizer keeps one)."""
    if _stored(inner):
        inner.write_state(p, key, value.reshape(p.shape))
    else:
        inner.state[p][key] = value
