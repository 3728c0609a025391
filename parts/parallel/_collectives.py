"""Every collective parts.parallel issues: group creation, the two conjugate autograd
collectives of tensor parallelism, and the gathers/reductions of the helpers."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from parts.comm import all_gather_objects

__all__ = ["group_ranks", "exchange_group_ranks", "new_groups", "copy_to_tp", "reduce_from_tp",
           "all_gather_tp", "all_reduce_sum", "all_reduce_max", "group_size", "group_rank"]


def _require_init(what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what} needs an initialised torch.distributed process group "
                           f"(call dist.init_process_group first, e.g. under torchrun)")


def group_size(group: Optional[Any]) -> int:
    """Ranks in ``group`` (1 without an initialised process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group: Optional[Any]) -> int:
    """This rank's index in ``group`` (0 without an initialised process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def group_ranks(group: Optional[Any]) -> list[int]:
    """Global ranks of ``group`` (the default group when None), in group-rank order."""
    _require_init("ParallelGrid")
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def exchange_group_ranks(mine: Sequence[int]) -> list[list[int]]:
    """Every world rank's ``mine`` (its parent group's global ranks), deduplicated and sorted."""
    everyone = all_gather_objects(list(mine))
    return sorted({tuple(ranks) for ranks in everyone})  # type: ignore[arg-type]


def new_groups(rank_lists: Sequence[Sequence[int]]) -> list[Any]:
    """``dist.new_group`` for every list, in order (every world rank must make the same calls)."""
    return [dist.new_group(ranks=list(ranks)) for ranks in rank_lists]


class _CopyToTP(torch.autograd.Function):
    """Identity in forward; all-reduce (sum) of the grad over the tp group in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce (sum) over the tp group in forward; identity for the grad in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Enter a tensor-parallel region: ``x`` as is; its grad is summed over ``group`` in backward."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Leave a tensor-parallel region: the sum of every rank's partial ``x``; grad passes through."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def all_gather_tp(x: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every tp rank's ``x`` (same shape everywhere), in tp-rank order; not differentiable."""
    if group_size(group) == 1:
        return [x.detach().clone()]
    x = x.detach().contiguous()
    out = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(out, x, group=group)
    return out


def all_reduce_sum(x: torch.Tensor, group: Optional[Any]) -> torch.Tensor:
    """Sum of ``x`` over ``group`` (in place; returned)."""
    if group_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def all_reduce_max(x: torch.Tensor, group: Optional[Any]) -> torch.Tensor:
    """Maximum of ``x`` over ``group`` (in place; returned)."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x
