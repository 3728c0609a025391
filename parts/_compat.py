"""The one place that papers over differences between torch versions (>= 2.4) and that
touches torch internals.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``; older releases only have the former.
``parts.comm`` calls these wrappers (uncounted: it counts bytes itself).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["all_gather_flat", "reduce_scatter_flat", "can_swap_storage_data", "swap_storage_data"]

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(output: torch.Tensor, input: torch.Tensor,
                    group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Any:
    """All-gather equal 1-D chunks ``input`` of every rank into ``output`` (rank order)."""
    return _ALL_GATHER(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                        group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Any:
    """Reduce ``input`` (world_size equal chunks) across ranks; this rank's chunk lands in ``output``."""
    return _REDUCE_SCATTER(output, input, op=op, group=group, async_op=async_op)


_SWAP_DATA = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)


def can_swap_storage_data() -> bool:
    """True if this torch can move the memory of one storage into another (``swap_storage_data``)."""
    return _SWAP_DATA is not None


def swap_storage_data(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory (pointer and byte size) of storages ``a`` and ``b``; tensors and
    views on either keep their storage object and see the other's bytes."""
    _SWAP_DATA(a, b)
