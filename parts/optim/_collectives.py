"""The collectives of parts.optim (grad reduce-scatter, norm, bucketed all-gather of the
updated partitions, state-dict gathers), on ``parts.comm``."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from parts.comm import GroupInfo, ReduceOp, all_gather, all_reduce, global_rank, group_info, reduce_scatter
from parts.comm.exact_norm import exact_global_norm

from .layout import BucketPiece


def reduce_scatter_mean(out: torch.Tensor, flat: torch.Tensor, info: GroupInfo) -> None:
    """This rank's partition of the mean of ``flat`` over ranks lands in ``out`` (sum, then divide)."""
    if info.world_size == 1:
        if out.data_ptr() != flat.data_ptr():
            out.copy_(flat)
        return
    if out.dtype == flat.dtype:
        reduce_scatter(out, flat, info)
    else:  # grads accumulated in a narrower dtype: reduce in that dtype, then widen
        tmp = torch.empty(out.numel(), dtype=flat.dtype, device=flat.device)
        reduce_scatter(tmp, flat, info)
        out.copy_(tmp)
    out.div_(info.world_size)


def all_reduce_norm(local: torch.Tensor, norm_type: float, info: GroupInfo,
                    extra_groups: Sequence[GroupInfo] = ()) -> torch.Tensor:
    """Combine per-rank partial norms (``sum |g|^p``, or max for inf) into the global norm.

    Reduced over ``info``'s group, then over each of ``extra_groups`` in turn (the other axes
    of a grid: a dp group then a tp group together cover every rank of a dp x tp grid once).
    """
    # NaN does not survive a MAX reduction everywhere; inf does (no host sync to find out)
    total = torch.where(torch.isfinite(local), local, torch.full_like(local, math.inf))
    op = ReduceOp.MAX if math.isinf(norm_type) else ReduceOp.SUM
    for each in (info, *extra_groups):
        all_reduce(total, each, op)
    if math.isinf(norm_type) or norm_type == 0:
        return total
    return total.pow(1.0 / norm_type)


def gather_buckets(buckets: Sequence[Sequence[BucketPiece]], masters: Sequence[torch.Tensor],
                   flats: Sequence[torch.Tensor], info: GroupInfo) -> None:
    """Cast every rank's fp32 partitions into the model-dtype flat buffers, one collective per bucket."""
    if info.world_size == 1:
        for flat, master in zip(flats, masters):
            flat.copy_(master)
        return
    world_size = info.world_size
    for bucket in buckets:
        first = bucket[0]
        part = masters[first.group].numel()
        if len(bucket) == 1 and first.start == 0 and first.stop == part:
            flat = flats[first.group]  # whole partition: gather straight into the flat buffer
            all_gather(flat, masters[first.group].to(flat.dtype), info, direct=True)
            continue
        length = bucket[-1].offset + bucket[-1].stop - bucket[-1].start
        dtype, device = flats[first.group].dtype, flats[first.group].device
        send = torch.empty(length, dtype=dtype, device=device)
        for p in bucket:
            send.narrow(0, p.offset, p.stop - p.start).copy_(masters[p.group][p.start:p.stop])
        recv = torch.empty(length * world_size, dtype=dtype, device=device)
        all_gather(recv, send, info, direct=True)
        rows = recv.view(world_size, length)
        for p in bucket:
            n = p.stop - p.start
            dst = flats[p.group].view(world_size, -1)[:, p.start:p.stop]
            dst.copy_(rows[:, p.offset:p.offset + n])


def all_gather_partition(part: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """Concatenation of every rank's equal-sized 1-D ``part``, in rank order."""
    if info.world_size == 1:
        return part.clone()
    out = torch.empty(part.numel() * info.world_size, dtype=part.dtype, device=part.device)
    all_gather(out, part.contiguous(), info)
    return out


def all_reduce_mean(t: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """fp32 mean of ``t`` over ranks (a new tensor), summed in ``t``'s dtype like the reduce-scatter."""
    out = all_reduce(t.clone(), info)
    return out.to(torch.float32).div_(info.world_size)


def norm_group_infos(groups: Sequence[object]) -> list[GroupInfo]:
    """The resolved ``norm_groups``; a group without this rank is an error naming its index."""
    infos = []
    for i, g in enumerate(groups):
        try:
            infos.append(group_info(g, f"norm_groups[{i}]"))  # type: ignore[arg-type]
        except ValueError:
            raise ValueError(f"BF16Optimizer: norm_groups[{i}] does not contain this process "
                             f"(global rank {global_rank()}); pass groups this rank is in") from None
    return infos


def reproducible_norm(grads: list[torch.Tensor], sharded_groups: list, flat_groups: list,
                      info: GroupInfo, extra: Sequence[GroupInfo] = ()) -> Optional[torch.Tensor]:
    """The global 2-norm of ``grads`` in fixed point (the same bits at any world size) if the sharded
    parameters belong to a model attached with ``reproducible=True``; None otherwise. Over ``info``
    and then each of ``extra`` (``norm_groups``: the other axes of a grid)."""
    if not reproducible(sharded_groups, flat_groups):
        return None
    count = sum(s.record.numel for sharded in sharded_groups for s in sharded)
    for each in extra:  # every rank of a grid axis counts its own pieces: a bound of them all
        count *= each.world_size
    return exact_global_norm(grads, info, count, extra=extra)


def reproducible(sharded_groups: list, flat_groups: list) -> bool:
    """True if the sharded parameters belong to a model attached with ``reproducible=True``;
    ValueError if parameters the optimizer shards itself (averaged in float) are beside them."""
    if not any(s.record.exact is not None for sharded in sharded_groups for s in sharded):
        return False
    flat = [name for fg in flat_groups if fg for name in fg.names]
    if flat:
        raise ValueError(f"BF16Optimizer: parameter {flat[0]!r} ({len(flat)} in all) is not built under "
                         f"parts.partition.partitioned(); the optimizer averages such grads in float, "
                         f"which reproducible mode (attach(model, reproducible=True)) cannot allow: "
                         f"build every parameter of the model under partitioned()")
    return True
