"""Construction-time interception: code that touches a released parameter gets it full.

While a ``partitioned`` context is active, a ``TorchFunctionMode`` sees every torch call.
When a call involves a partitioned parameter whose full tensor is released:

* shape queries (``p.shape``, ``p.size()``, ``p.dim()``, ``p.ndim``, ``p.numel()``) are
  answered from the record without any communication, so fan-in computations work;
* anything else gathers the parameter first ("touch"), so the call sees and writes the
  real full tensor; in-place writes are never dropped. With ``partitioned(dtype=...)`` the
  touched tensor is upcast to the dtype the parameter was created in (init code such as
  ``orthogonal_`` may not support bf16) and cast back when re-sharded, so overwriting
  inits equal the plain build cast to ``dtype``; read-modify-write inits see the values
  already rounded to ``dtype``.

Touched parameters are re-sharded (rank 0's values broadcast, every rank keeps its
slice) when the innermost *frame* that touched them ends. Frames are: one ``nn.init``
function call, one ``fn(module)`` inside ``Module.apply``, one module's ``__init__``,
and the whole context. So ``self.apply(self._init_weights)`` holds one module's full
parameters at a time, and an alias like ``w = child.weight.data`` stays valid until the
constructor that took it returns.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from parts._compat import TENSOR_BASE
from parts.partition.core.gather import gather, release
from parts.partition.core.param import ParamStatus, in_internal, internal, is_partitioned, meta, metas_sorted
from parts.partition.core.sharding import reshard

_SHAPE_ATTRS = {"shape", "ndim"}
_SHAPE_METHODS = {"size", "dim", "numel", "nelement", "ndimension"}

_frames: list[dict[int, nn.Parameter]] = []
"""Open frames, innermost last. Process-wide like the ``nn.Module`` patches of ``partitioned``
that open them (construct.py's ``_state``); empty whenever no ``partitioned`` context is active."""


def push_frame() -> None:
    """Open a frame: parameters touched from now on belong to it."""
    _frames.append({})


def pop_frame(ok: bool = True) -> None:
    """Close the innermost frame: re-shard its touched params (``ok``) or drop their changes."""
    touched = _frames.pop()
    if ok:
        flush(list(touched.values()))
    else:
        release(list(touched.values()))


@contextlib.contextmanager
def frame() -> Iterator[None]:
    """A frame around a block; on an exception changes are discarded without collectives."""
    push_frame()
    ok = False
    try:
        yield
        ok = True
    finally:
        pop_frame(ok)


@internal
def flush(params: list[nn.Parameter]) -> None:
    """Broadcast rank 0's full values of the still-gathered ``params`` and re-shard them."""
    pairs = [(p, m) for p, m in metas_sorted(params) if m.status is ParamStatus.AVAILABLE]
    by_group: dict[int, list] = {}
    for p, m in pairs:
        by_group.setdefault(id(m.info.group), []).append((p, m))
    for group_pairs in by_group.values():
        reshard(group_pairs, 0, keep=False)


def _released(args: tuple, kwargs: dict) -> list[nn.Parameter]:
    """Partitioned, not-available parameters among the (one level deep) arguments."""
    found = []
    for a in (*args, *kwargs.values()):
        items = a if isinstance(a, (list, tuple)) else (a,)
        for t in items:
            if isinstance(t, torch.Tensor) and is_partitioned(t) and meta(t).status is not ParamStatus.AVAILABLE:
                found.append(t)
    return found


def _shape_answer(func: Any, args: tuple, kwargs: dict, released: list) -> Any:
    """The answer of a shape query on a released param (from its record), else ``NotImplemented``."""
    if not args or args[0] is not released[0] or len(released) != 1:
        return NotImplemented
    shape = meta(args[0]).shape
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") == "__get__" and getattr(owner, "__name__", "") in _SHAPE_ATTRS:
        return shape if owner.__name__ == "shape" else len(shape)
    name = getattr(func, "__name__", "")
    if name not in _SHAPE_METHODS or getattr(func, "__objclass__", None) is not TENSOR_BASE:
        return NotImplemented
    if name == "size":
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return shape if dim is None else shape[dim]
    return shape.numel() if name in ("numel", "nelement") else len(shape)


class Interceptor(TorchFunctionMode):
    """Gathers released params that torch code touches inside ``partitioned`` (see module doc)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if in_internal():
            return func(*args, **kwargs)
        released = _released(args, kwargs)
        if not released:
            return func(*args, **kwargs)
        answer = _shape_answer(func, args, kwargs, released)
        if answer is not NotImplemented:
            return answer
        if getattr(func, "__module__", None) == "torch.nn.init":
            with frame():
                _touch(released)
                return func(*args, **kwargs)
        _touch(released)
        return func(*args, **kwargs)


def _touch(params: list[nn.Parameter]) -> None:
    """Gather ``params`` (waiting in-flight ones) and record them in the innermost frame."""
    fetch = [p for p in params if meta(p).status is ParamStatus.NOT_AVAILABLE]
    gather(params)
    for p in fetch:
        _frames[-1][id(p)] = p
        init_dtype = meta(p).init_dtype
        if init_dtype is not None and init_dtype != p.dtype:
            p.data = p.data.to(init_dtype)  # init code runs in the dtype the param was created in
