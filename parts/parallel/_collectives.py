"""Every collective parts.parallel issues: group creation, the two conjugate autograd
collectives of tensor parallelism, and the gathers/reductions of the helpers (on parts.comm)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch.autograd.function import FunctionCtx

from parts.comm import (GroupArg, ProcessGroup, all_gather_list, all_gather_objects,
                        all_reduce, group_info, new_group, require_distributed)


def group_size(group: GroupArg) -> int:
    """Ranks in ``group`` (1 without an initialised process group)."""
    return group_info(group, "parts.parallel").world_size


def group_rank(group: GroupArg) -> int:
    """This rank's index in ``group`` (0 without an initialised process group)."""
    return group_info(group, "parts.parallel").rank


def group_ranks(group: GroupArg) -> list[int]:
    """Global ranks of ``group`` (the default group when None), in group-rank order."""
    require_distributed("ParallelGrid")
    return group_info(group, "ParallelGrid").global_ranks()


def exchange_group_ranks(mine: Sequence[int]) -> list[list[int]]:
    """Every world rank's ``mine`` (its parent group's global ranks), deduplicated and sorted."""
    everyone = all_gather_objects(list(mine))
    return sorted({tuple(ranks) for ranks in everyone})  # type: ignore[arg-type]


def new_groups(rank_lists: Sequence[Sequence[int]]) -> list[ProcessGroup]:
    """A new process group for every list, in order (every world rank must make the same calls)."""
    return [new_group(ranks) for ranks in rank_lists]


class _CopyToTP(torch.autograd.Function):
    """Identity in forward; all-reduce (sum) of the grad over the tp group in backward."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: GroupArg) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)
        all_reduce(grad, group_info(ctx.group))
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce (sum) over the tp group in forward; identity for the grad in backward."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: GroupArg) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        all_reduce(out, group_info(group))
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: GroupArg) -> torch.Tensor:
    """Enter a tensor-parallel region: ``x`` as is; its grad is summed over ``group`` in backward."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: GroupArg) -> torch.Tensor:
    """Leave a tensor-parallel region: the sum of every rank's partial ``x``; grad passes through."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def all_gather_tp(x: torch.Tensor, group: GroupArg) -> list[torch.Tensor]:
    """Every tp rank's ``x`` (same shape everywhere), in tp-rank order; not differentiable."""
    info = group_info(group, "parts.parallel")
    if info.world_size == 1:
        return [x.detach().clone()]
    return all_gather_list(x.detach().contiguous(), info)
