"""The collectives of parts.observe: element-wise MIN and MAX across ranks for timer logs."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True when torch.distributed is available and initialised."""
    return dist.is_available() and dist.is_initialized()


def rank(group: Optional[Any] = None) -> int:
    """This process's rank in ``group`` (default group), 0 when not distributed."""
    return dist.get_rank(group) if is_distributed() else 0


def min_max(values: torch.Tensor,
            group: Optional[Any] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise minimum and maximum of ``values`` over ``group``; local copies when not distributed."""
    if not is_distributed():
        return values.clone(), values.clone()
    device = _comm_device(group)
    lo, hi = values.to(device), values.to(device, copy=True)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    return lo.cpu(), hi.cpu()


def _comm_device(group: Optional[Any]) -> torch.device:
    """CPU for gloo, else the current accelerator (the device NCCL-like backends need)."""
    acc = getattr(torch, "accelerator", None)
    if dist.get_backend(group) == "gloo" or acc is None or not acc.is_available():
        return torch.device("cpu")
    return acc.current_accelerator()
