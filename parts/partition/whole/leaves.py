"""Shard leaves that answer with their parameter's full shape, until an optimizer is routed.

``shards(model)`` hands an optimizer one leaf per parameter. For a parameter of two or more
dimensions that leaf is a ``ShapedShard``: it shares the shard's storage (its data *is* the
flat shard), but ``shape``, ``size()``, ``ndim``, ``dim()`` and ``numel()`` are the full
parameter's, so an optimizer's constructor checks (``torch.optim.Muon``: 2-D only) and
grouping code see the model's shapes; ``.grad`` is the grad shard. Before the optimizer's
first step (or any ``parts`` call on it) ``route`` replaces each such leaf in its param
groups: by the shard itself (an element-wise optimizer) or by a whole tensor stepped by one
owner rank. Ops on a ``ShapedShard`` run on the flat shard and give plain tensors.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from parts._compat import alias_as, default_torch_function

_RECORD = "_parts_shaped"


class ShapedShard(torch.Tensor):
    """A shard leaf reporting its parameter's full shape; its ``.grad`` is the grad shard."""

    __torch_function__ = default_torch_function

    def _record(self) -> Any:
        record = self.__dict__[_RECORD]()
        if record is None:
            raise RuntimeError("parts.partition: the parameter of this shard leaf no longer exists")
        return record

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        """The full parameter's shape."""
        return torch.Size(self._record().shape)

    @property
    def ndim(self) -> int:  # type: ignore[override]
        """The full parameter's number of dimensions."""
        return len(self._record().shape)

    def size(self, dim: Optional[int] = None) -> Any:  # type: ignore[override]
        """The full parameter's size (of dimension ``dim``)."""
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:  # type: ignore[override]
        """The full parameter's number of dimensions."""
        return self.ndim

    def numel(self) -> int:  # type: ignore[override]
        """The full parameter's number of elements."""
        return self._record().numel

    @property
    def grad(self) -> Optional[torch.Tensor]:  # type: ignore[override]
        """The grad shard (flat, this rank's elements)."""
        return self._record().grad_shard

    @grad.setter
    def grad(self, value: Optional[torch.Tensor]) -> None:
        self._record().grad_shard = value

    def __repr__(self) -> str:
        return f"ShapedShard({self._record().describe()}, shard of {self.shard_numel} elements)"

    @property
    def shard_numel(self) -> int:
        """Elements this rank holds (the flat shard's size)."""
        return self._record().layout.shard_numel


def shaped_shard(record: Any) -> torch.Tensor:
    """A ``ShapedShard`` over ``record.shard``."""
    leaf = alias_as(ShapedShard, record.shard, requires_grad=record.shard.requires_grad)
    leaf.__dict__[_RECORD] = weakref.ref(record)
    return leaf


def record_of_leaf(t: Any) -> Optional[Any]:
    """The record behind a ``ShapedShard`` (None for any other object)."""
    ref = getattr(t, "__dict__", {}).get(_RECORD) if type(t) is ShapedShard else None
    return ref() if ref is not None else None
