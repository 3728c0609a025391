"""Gradients of sharded parameters cannot be read the wrong way without an error.

A sharded parameter's gradient lives in its grad shard (``meta(p).grad_shard``); ``p.grad``
stays None once it is reduce-scattered. Code written for unsharded models reads ``p.grad``
(``torch.nn.utils.clip_grad_norm_``, ``Module.zero_grad``, an optimizer built on
``model.parameters()``) and would silently see no gradient: a norm of 0, no clipping, no
step. So sharded parameters get the class ``ShardedParameter``, whose ``grad`` property
raises, naming the right function, when ``p.grad`` is None but a grad shard holds the
gradient (library code, marked ``internal``, reads it freely). No op pays for it: the
class only adds a Python property, it does not override ``__torch_function__``.

Grad shards are ``GradShard`` tensors: every op works as on a plain tensor except a norm
(``torch.nn.utils.clip_grad_norm_`` on ``shards(model)``, ``get_total_norm``,
``vector_norm``, ``Tensor.norm``), which would be this rank's part of the norm only; it
raises and names ``parts.partition.clip_grad_norm_``. ``local(g)`` is the same memory as a
plain tensor, for a deliberate per-rank norm.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Optional

import torch
from torch import nn

from parts._compat import TENSOR_BASE, default_torch_function

ATTR = "_parts_meta"
_raw_grad = TENSOR_BASE.grad
_raw_data = TENSOR_BASE.data
_raw_requires_grad = TENSOR_BASE.requires_grad


class _Internal(contextlib.ContextDecorator, threading.local):
    """Marks library code: the construction-time interceptor of ``partitioned`` and the grad
    guard stand aside. The nesting depth is per thread: library code running on one thread
    does not switch the guards off for another."""

    depth = 0

    def __enter__(self) -> "_Internal":
        self.depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1


internal = _Internal()


def in_internal() -> bool:
    """True while library code runs (the interceptor and the grad guard stand aside)."""
    return internal.depth > 0


def raw_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    """``p.grad`` without the guard (library code)."""
    return _raw_grad.__get__(p)


def set_raw_grad(p: torch.Tensor, value: Optional[torch.Tensor]) -> None:
    """Set ``p.grad`` without the guard (library code)."""
    _raw_grad.__set__(p, value)


def set_full_grad(p: torch.Tensor, grad: torch.Tensor) -> None:
    """Give ``p`` the full grad ``grad`` (library code), also while ``p`` is released: torch checks
    a grad against the data's size, dtype and device, so the data is ``grad`` for that moment."""
    data = _raw_data.__get__(p)
    if (data.shape, data.dtype, data.device) == (grad.shape, grad.dtype, grad.device):
        _raw_grad.__set__(p, grad)
        return
    _raw_data.__set__(p, grad)
    try:
        _raw_grad.__set__(p, grad)
    finally:
        _raw_data.__set__(p, data)


def _moved_message(record: Any) -> str:
    return (f"parts.partition: {record.describe()} is sharded over {record.world_size} rank(s): its "
            f"gradient is in its grad shard (parts.partition.meta(p).grad_shard), p.grad is None, so "
            f"code reading p.grad would silently see no gradient. Clip with "
            f"parts.partition.clip_grad_norm_(model, max_norm) (not torch.nn.utils.clip_grad_norm_), "
            f"step the shards (torch.optim.AdamW(parts.partition.shards(model))), clear them with "
            f"optimizer.zero_grad() or model.zero_grad() of an attached model")


def _get_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    grad = _raw_grad.__get__(p)
    if grad is None and not in_internal():
        record = p.__dict__.get(ATTR)
        if record is not None and record.grad_shard is not None:
            raise RuntimeError(_moved_message(record))
    return grad


def _set_data(p: torch.Tensor, value: torch.Tensor) -> None:
    record = p.__dict__.get(ATTR)
    if record is not None and value.numel() != 0 and tuple(value.shape) != tuple(record.shape):
        raise RuntimeError(
            f"parts.partition: {record.describe()} is sharded over {record.world_size} rank(s); "
            f"`p.data = <tensor of shape {tuple(value.shape)}>` would replace it behind its shards "
            f"(Hugging Face's resize_token_embeddings works on a model built under partitioned() "
            f"or partition_module, before attach: parts.partition.resize_token_embeddings). Build "
            f"the model at the new size under partitioned() and load the weights with "
            f"load_full_state_dict")
    _raw_data.__set__(p, value)


def _set_requires_grad(p: torch.Tensor, flag: bool) -> None:
    _raw_requires_grad.__set__(p, flag)
    record = p.__dict__.get(ATTR)
    if record is not None:
        follow_requires_grad(record.shard, flag)


def follow_requires_grad(shard: torch.Tensor, flag: bool) -> None:
    """Give a shard its parameter's ``requires_grad`` (a frozen parameter's shard looks frozen to a
    ``requires_grad`` filter); the shard's grad comes from the grad reduction, never from autograd."""
    if shard.is_leaf and (shard.is_floating_point() or shard.is_complex()) and shard.requires_grad != flag:
        shard.requires_grad_(flag)


class ShardedParameter(nn.Parameter):
    """The class of a sharded (plain ``nn.Parameter``) parameter: ``p.grad`` is guarded, and
    ``requires_grad`` is mirrored on the shard."""

    grad = property(_get_grad, _raw_grad.__set__, _raw_grad.__delete__,
                    doc="The full gradient; raises while the gradient is in the grad shard.")
    data = property(_raw_data.__get__, _set_data,
                    doc="The tensor's data; replacing it by one of another shape raises.")
    requires_grad = property(_raw_requires_grad.__get__, _set_requires_grad,
                             doc="Whether the parameter trains; its shard follows.")

    def requires_grad_(self, requires_grad: bool = True) -> "ShardedParameter":
        """Set ``requires_grad`` on the parameter and its shard."""
        _set_requires_grad(self, requires_grad)
        return self

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        """A gathered sharded parameter copies to an ordinary full ``nn.Parameter``."""
        if id(self) not in memo:
            memo[id(self)] = nn.Parameter(self.data.clone(memory_format=torch.preserve_format),
                                          self.requires_grad)
        return memo[id(self)]


_NORMS = frozenset({torch._foreach_norm, torch.linalg.vector_norm, torch.linalg.norm, torch.norm,
                    torch.Tensor.norm})


class GradShard(torch.Tensor):
    """A grad shard: a plain tensor for every op but a norm, which would be one rank's part only."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func in _NORMS and not in_internal():
            raise RuntimeError(
                "parts.partition: a norm of grad shards is this rank's part of the norm only (each "
                "rank holds 1/world of every gradient), so torch.nn.utils.clip_grad_norm_(shards(model)) "
                "would clip by a per-rank norm. Use parts.partition.clip_grad_norm_(model, max_norm) "
                "(the global norm over all ranks); for a deliberate per-rank norm, "
                "parts.partition.core.grad_guard.local(grad)")
        return default_torch_function(func, types, args, kwargs or {})


def as_grad_shard(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a ``GradShard`` (same memory)."""
    return t if type(t) is GradShard else t.as_subclass(GradShard)


def local(t: torch.Tensor) -> torch.Tensor:
    """A grad shard as a plain tensor (same memory): its norms are this rank's part."""
    return t.as_subclass(torch.Tensor) if type(t) is GradShard else t
