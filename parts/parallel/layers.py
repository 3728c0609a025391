"""Column- and row-parallel Linear layers, and slicing full tensors to and from tp pieces.

A weight is built full on every tp rank from the same random stream (or by ``init_method``)
and sliced, so a tp layer equals the ``nn.Linear`` built with the same seed. Parameters that
are split carry ``tp_dim`` and ``tp_chunks`` attributes (see :func:`tp_split`); the others are
replicated across the tp group.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from parts.comm import GroupArg, WeakGroup

from . import _collectives as C
from .layout import tp_ranges

InitMethod = Callable[[torch.Tensor], Any]


def shard_tensor(full: torch.Tensor, dim: int, tp_size: int, tp_rank: int,
                 chunks: int = 1) -> torch.Tensor:
    """The piece of ``full`` along ``dim`` that ``tp_rank`` owns (a new contiguous tensor)."""
    ranges = tp_ranges(full.shape[dim], tp_size, tp_rank, chunks)
    return torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim=dim).contiguous()


def unshard_tensor(pieces: list[torch.Tensor], dim: int, chunks: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_tensor`: the full tensor from every tp rank's piece, in rank order."""
    split = [p.chunk(chunks, dim=dim) for p in pieces]
    return torch.cat([split[r][c] for c in range(chunks) for r in range(len(pieces))], dim=dim)


def mark_tp_split(p: torch.Tensor, dim: int, chunks: int = 1) -> None:
    """Record that ``p`` is this rank's piece of a tensor split along ``dim`` in ``chunks`` blocks."""
    p.tp_dim, p.tp_chunks = dim, chunks


def tp_split(p: torch.Tensor) -> Optional[tuple[int, int]]:
    """``(dim, chunks)`` of a tensor-parallel piece, or None for a parameter replicated over tp."""
    dim = getattr(p, "tp_dim", None)
    return None if dim is None else (dim, getattr(p, "tp_chunks", 1))


def _full_init(out_features: int, in_features: int, bias: bool,
               init_method: Optional[InitMethod]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Full fp32 weight and bias on CPU: ``nn.Linear``'s init, or ``init_method`` and zero bias."""
    weight = torch.empty(out_features, in_features, device="cpu")
    full_bias = torch.zeros(out_features, device="cpu") if bias else None
    with torch.no_grad():
        if init_method is not None:
            init_method(weight)
        else:  # the same draws, in the same order, as nn.Linear.reset_parameters
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
            if full_bias is not None:
                bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
                nn.init.uniform_(full_bias, -bound, bound)
    return weight, full_bias


class _TPLinear(nn.Module):
    """Shared set-up: group, sizes, target dtype and device."""

    group = WeakGroup()  # not kept alive past destroy_process_group (see WeakGroup)

    def __init__(self, in_features: int, out_features: int, group: GroupArg,
                 dtype: Optional[torch.dtype], device: Optional[torch.device]) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.tp_size, self.tp_rank = C.group_size(group), C.group_rank(group)
        self._to = dict(dtype=dtype, device=device)

    def _piece(self, full: torch.Tensor, dim: int, chunks: int = 1) -> torch.Tensor:
        """This rank's slice of ``full``; a clear error naming the layer if it does not split."""
        try:
            return shard_tensor(full, dim, self.tp_size, self.tp_rank, chunks)
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}({self.in_features}, {self.out_features}): "
                             f"{err}") from None

    def _param(self, t: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(t.to(**self._to))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tp_size={self.tp_size}, tp_rank={self.tp_rank}")


class ColumnParallelLinear(_TPLinear):
    """``y_local = x W_local^T + b_local``: output features split over ``group`` (input replicated).

    ``chunks`` > 1 splits each of ``chunks`` equal blocks of the output separately (a fused q, k, v
    projection uses 3), so each rank gets whole heads of every block.
    """

    def __init__(self, in_features: int, out_features: int, group: GroupArg = None, *,
                 bias: bool = True, chunks: int = 1, init_method: Optional[InitMethod] = None,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> None:
        super().__init__(in_features, out_features, group, dtype, device)
        weight, full_bias = _full_init(out_features, in_features, bias, init_method)
        self.chunks = chunks
        self.weight = self._param(self._piece(weight, 0, chunks))
        mark_tp_split(self.weight, 0, chunks)
        self.bias = None
        if full_bias is not None:
            self.bias = self._param(self._piece(full_bias, 0, chunks))
            mark_tp_split(self.bias, 0, chunks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(C.copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(_TPLinear):
    """``y = sum_r x_r W_r^T + b``: input features split over ``group``, output all-reduced.

    The input is this rank's slice of the features (a column-parallel output); the bias is
    replicated and added once, after the all-reduce.
    """

    def __init__(self, in_features: int, out_features: int, group: GroupArg = None, *,
                 bias: bool = True, init_method: Optional[InitMethod] = None,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> None:
        super().__init__(in_features, out_features, group, dtype, device)
        weight, full_bias = _full_init(out_features, in_features, bias, init_method)
        self.weight = self._param(self._piece(weight, 1))
        mark_tp_split(self.weight, 1)
        self.bias = None if full_bias is None else self._param(full_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = C.reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias
