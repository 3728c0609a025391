"""Every collective parts.optim issues, built on parts._compat (gloo, NCCL, ...)."""

from __future__ import annotations

import math
import os
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from parts._compat import all_gather_direct, all_gather_flat, reduce_scatter_flat

from .layout import BucketPiece

__all__ = ["check_member", "world_and_rank", "global_rank", "reduce_scatter_mean", "all_reduce_norm",
           "all_reduce_any", "gather_buckets", "all_gather_partition", "all_reduce_mean"]


def check_member(group: Optional[Any], what: str) -> None:
    """Raise ValueError naming this rank and ``group``'s ranks if this rank is not in ``group``."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return
    if group is not dist.GroupMember.NON_GROUP_MEMBER and dist.get_rank(group) >= 0:
        return
    try:
        ranks = f"global ranks {dist.get_process_group_ranks(group)}"
    except Exception:  # noqa: BLE001 - a non-member may not see the group's ranks
        ranks = "ranks unknown to this process"
    raise ValueError(f"{what}: rank {dist.get_rank()} is not a member of the process group passed "
                     f"({ranks}); only the ranks of a group may use it")


def world_and_rank(group: Optional[Any]) -> tuple[int, int]:
    """(world size, rank) of ``group``; (1, 0) without an initialised process group."""
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if not (dist.is_available() and dist.is_initialized()):
        if env_world > 1:
            raise RuntimeError(f"BF16Optimizer: WORLD_SIZE={env_world} but torch.distributed is "
                               "not initialised; call init_process_group first (otherwise every "
                               "rank would silently hold the whole optimizer state)")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def global_rank() -> int:
    """This process's rank in the default group (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def reduce_scatter_mean(out: torch.Tensor, flat: torch.Tensor, world_size: int,
                        group: Optional[Any]) -> None:
    """This rank's partition of the mean of ``flat`` over ranks lands in ``out`` (sum, then divide)."""
    if world_size == 1:
        if out.data_ptr() != flat.data_ptr():
            out.copy_(flat)
        return
    if out.dtype == flat.dtype:
        reduce_scatter_flat(out, flat, op=dist.ReduceOp.SUM, group=group)
    else:  # grads accumulated in a narrower dtype: reduce in that dtype, then widen
        tmp = torch.empty(out.numel(), dtype=flat.dtype, device=flat.device)
        reduce_scatter_flat(tmp, flat, op=dist.ReduceOp.SUM, group=group)
        out.copy_(tmp)
    out.div_(world_size)


def all_reduce_norm(local: torch.Tensor, norm_type: float, world_size: int,
                    group: Optional[Any], extra_groups: Sequence[Any] = ()) -> torch.Tensor:
    """Combine per-rank partial norms (``sum |g|^p``, or max for inf) into the global norm.

    Reduced over ``group``, then over each of ``extra_groups`` in turn (the other axes of a
    grid: a dp group then a tp group together cover every rank of a dp x tp grid once).
    """
    total = local.clone()
    if not bool(torch.isfinite(total)):
        total.fill_(math.inf)  # NaN does not survive a MAX reduction everywhere; inf does
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    if world_size > 1:
        dist.all_reduce(total, op=op, group=group)
    for extra in extra_groups:
        if dist.get_world_size(extra) > 1:
            dist.all_reduce(total, op=op, group=extra)
    if math.isinf(norm_type) or norm_type == 0:
        return total
    return total.pow(1.0 / norm_type)


def all_reduce_any(flag: bool, device: torch.device, world_size: int,
                   group: Optional[Any]) -> bool:
    """True on every rank if ``flag`` is true on any rank."""
    if world_size == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


def gather_buckets(buckets: Sequence[Sequence[BucketPiece]], masters: Sequence[torch.Tensor],
                   flats: Sequence[torch.Tensor], rank: int, world_size: int,
                   group: Optional[Any]) -> None:
    """Cast every rank's fp32 partitions into the model-dtype flat buffers, one collective per bucket."""
    if world_size == 1:
        for flat, master in zip(flats, masters):
            flat.copy_(master)
        return
    for bucket in buckets:
        first = bucket[0]
        part = masters[first.group].numel()
        if len(bucket) == 1 and first.start == 0 and first.stop == part:
            flat = flats[first.group]  # whole partition: gather straight into the flat buffer
            all_gather_direct(flat, masters[first.group].to(flat.dtype), group=group)
            continue
        length = bucket[-1].offset + bucket[-1].stop - bucket[-1].start
        dtype, device = flats[first.group].dtype, flats[first.group].device
        send = torch.empty(length, dtype=dtype, device=device)
        for p in bucket:
            send.narrow(0, p.offset, p.stop - p.start).copy_(masters[p.group][p.start:p.stop])
        recv = torch.empty(length * world_size, dtype=dtype, device=device)
        all_gather_direct(recv, send, group=group)
        rows = recv.view(world_size, length)
        for p in bucket:
            n = p.stop - p.start
            dst = flats[p.group].view(world_size, -1)[:, p.start:p.stop]
            dst.copy_(rows[:, p.offset:p.offset + n])


def all_gather_partition(part: torch.Tensor, world_size: int,
                         group: Optional[Any]) -> torch.Tensor:
    """Concatenation of every rank's equal-sized 1-D ``part``, in rank order."""
    if world_size == 1:
        return part.clone()
    out = torch.empty(part.numel() * world_size, dtype=part.dtype, device=part.device)
    all_gather_flat(out, part.contiguous(), group=group)
    return out


def all_reduce_mean(t: torch.Tensor, world_size: int, group: Optional[Any]) -> torch.Tensor:
    """fp32 mean of ``t`` over ranks (a new tensor), summed in ``t``'s dtype like the reduce-scatter."""
    out = t.clone()
    if world_size > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out.to(torch.float32).div_(world_size)
