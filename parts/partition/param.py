"""The record of a sharded parameter (``ParamMeta``) and how to find it (``meta``).

A sharded parameter stays the same ``nn.Parameter`` object; its record lives in the
attribute ``_parts_meta``. While released, ``p.data`` is an empty tensor (numel 0, the
shard dtype, the compute device); the global shape and numel are on the record.
All fresh tensors of this package come from ``alloc`` so that a test can poison them.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from torch import nn

from parts.partition._collectives import GroupInfo
from parts.partition.layout import ShardLayout

__all__ = ["ParamStatus", "ParamMeta", "is_partitioned", "meta", "alloc", "unique_params", "internal",
           "empty_like_released"]

_ATTR = "_parts_meta"


class ParamStatus(enum.Enum):
    """Whether a sharded parameter's full tensor is in ``p.data``."""

    AVAILABLE = "available"
    NOT_AVAILABLE = "not_available"
    INFLIGHT = "inflight"


@dataclass(eq=False)
class ParamMeta:
    """Global shape, layout, local shard, grad shard and status of one sharded parameter."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    layout: ShardLayout
    shard: torch.Tensor = field(repr=False)
    info: GroupInfo
    id: int
    device: torch.device
    status: ParamStatus = ParamStatus.NOT_AVAILABLE
    module_name: str = ""
    module_type: str = ""
    handle: Optional[Any] = None
    init_dtype: Optional[torch.dtype] = None  # dtype the parameter was created in (before ``dtype=``)
    _grad: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        """Elements of the full (global) parameter."""
        return self.layout.numel

    @property
    def group(self) -> Any:
        """The process group (None where torch.distributed is not initialised)."""
        return self.info.group

    @property
    def rank(self) -> int:
        """This process's rank in ``group``."""
        return self.info.rank

    @property
    def world_size(self) -> int:
        """Ranks the parameter is sharded over."""
        return self.info.world_size

    @property
    def grad_shard(self) -> Optional[torch.Tensor]:
        """This rank's gradient shard (1-D, ``shard_numel``); it is ``shard.grad`` when dtypes match."""
        return self.shard.grad if self.shard.grad is not None else self._grad

    @grad_shard.setter
    def grad_shard(self, value: Optional[torch.Tensor]) -> None:
        self._grad, self.shard.grad = None, None
        if value is None:
            return
        if value.dtype == self.shard.dtype and value.device == self.shard.device:
            self.shard.grad = value
        else:
            self._grad = value

    def describe(self) -> str:
        """``'name' (shape) of module 'module_name' (Type)`` for error messages."""
        where = f" of module '{self.module_name}' ({self.module_type})" if self.module_type else ""
        return f"parameter '{self.name}' {tuple(self.shape)}{where}"


def is_partitioned(p: Any) -> bool:
    """True if ``p`` is a parameter sharded by ``parts.partition``."""
    return isinstance(p, torch.Tensor) and _ATTR in getattr(p, "__dict__", {})


def meta(p: torch.Tensor) -> ParamMeta:
    """The ``ParamMeta`` of a sharded parameter; TypeError naming it otherwise."""
    record = getattr(p, "__dict__", {}).get(_ATTR)
    if record is None:
        shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
        raise TypeError(f"parts.partition: tensor {shape} is not a partitioned parameter; shard its "
                        f"module with partition_module(module) or build it inside partitioned()")
    return record


def attach_meta(p: nn.Parameter, record: ParamMeta) -> None:
    """Store ``record`` on ``p`` (internal)."""
    p.__dict__[_ATTR] = record


def _empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


allocator = _empty
"""The function behind ``alloc``; a test may replace it (e.g. to poison fresh memory)."""


def alloc(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fresh uninitialised 1-D tensor: every buffer and full tensor of this package comes from here."""
    return allocator(numel, dtype, device)


def empty_like_released(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The numel-0 tensor a released parameter holds in ``p.data``."""
    return torch.empty(0, dtype=dtype, device=device)


def unique_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` without duplicates (by identity), order kept; accepts a single tensor."""
    if isinstance(params, torch.Tensor):
        params = [params]
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def metas_sorted(params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, ParamMeta]]:
    """``(p, meta(p))`` pairs of unique params sorted by the rank-consistent id."""
    pairs = [(p, meta(p)) for p in unique_params(params)]
    return sorted(pairs, key=lambda pm: pm[1].id)


def common_info(pairs: list[tuple[torch.Tensor, ParamMeta]], group: Any, what: str) -> Optional[GroupInfo]:
    """The one group of ``pairs`` (checked against ``group`` if given); ValueError naming mismatches."""
    if not pairs:
        return None
    first = pairs[0][1]
    for _, m in pairs:
        if m.info.group is not first.info.group:
            raise ValueError(f"{what}: parameters of different process groups in one call: "
                             f"{first.describe()} and {m.describe()}; call once per group")
    if group is not None and group is not first.info.group:
        raise ValueError(f"{what}: {first.describe()} is sharded over another process group "
                         f"than the group passed")
    return first.info


class _Internal(contextlib.ContextDecorator):
    """Marks library code: the construction-time interceptor of ``partitioned`` stands aside."""

    depth = 0

    def __enter__(self) -> "_Internal":
        _Internal.depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        _Internal.depth -= 1


internal = _Internal()


def in_internal() -> bool:
    """True while library code runs (the interceptor must not act)."""
    return _Internal.depth > 0
