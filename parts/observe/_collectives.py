"""The collectives of parts.observe: element-wise MIN and MAX across ranks for timer logs."""

from __future__ import annotations

import torch

from parts.comm import GroupArg, ReduceOp, all_reduce, comm_device, group_info, is_distributed

__all__ = ["rank", "min_max"]


def rank(group: GroupArg = None) -> int:
    """This process's rank in ``group`` (default group), 0 when not distributed."""
    return group_info(group, "parts.observe").rank


def min_max(values: torch.Tensor, group: GroupArg = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise minimum and maximum of ``values`` over ``group``; local copies when not distributed."""
    if not is_distributed():
        return values.clone(), values.clone()
    info = group_info(group, "Timers.log(group=...)")
    device = comm_device(info)
    lo, hi = values.to(device), values.to(device, copy=True)
    all_reduce(lo, info, ReduceOp.MIN)
    all_reduce(hi, info, ReduceOp.MAX)
    return lo.cpu(), hi.cpu()
