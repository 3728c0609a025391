"""Every collective of ``parts.partition``, with a byte counter the coordinator can read.

Built on ``parts._compat`` (``all_gather_direct`` / ``reduce_scatter_consuming``) and
``torch.distributed.broadcast``. A process without an initialised process group is a
world of one (collectives become local copies), unless the environment says
``WORLD_SIZE > 1``: then the caller forgot ``init_process_group`` and every rank would
silently hold the whole model, so ``resolve_group`` raises.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
import torch.distributed as dist

from parts.comm import objects as comm_objects
from parts._compat import WorkList, all_gather_direct, reduce_scatter_consuming

__all__ = ["CommCounter", "comm_counter", "GroupInfo", "resolve_group", "all_gather_many",
           "reduce_scatter_many", "broadcast", "broadcast_object", "Work", "WorkList"]


@dataclass
class CommCounter:
    """Bytes and calls of the collectives issued by ``parts.partition`` in this process."""

    allgather_bytes: int = 0
    allgather_calls: int = 0
    reduce_scatter_bytes: int = 0
    reduce_scatter_calls: int = 0
    broadcast_bytes: int = 0
    broadcast_calls: int = 0

    def reset(self) -> None:
        """Zero every counter (e.g. at the start of a step)."""
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)

    def snapshot(self) -> dict[str, int]:
        """The counters as a plain dict."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


comm_counter = CommCounter()
"""Process-wide counter: all-gather bytes are output (full) bytes, reduce-scatter bytes input (full)
bytes; a call is one ``*_many`` group. On gloo an all-gather is one broadcast per rank and
a reduce-scatter a direct exchange of chunks (see ``parts._compat``): the same bytes."""


@dataclass(frozen=True)
class GroupInfo:
    """A resolved process group: the handle to pass to torch, this rank in it, its size."""

    group: Any
    rank: int
    world_size: int

    def global_rank(self, group_rank: int) -> int:
        """Global rank of ``group_rank`` in this group (for ``broadcast``'s ``src``)."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)


def _env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def resolve_group(group: Any = None) -> GroupInfo:
    """Resolve ``group`` (None = the default group), refusing an accidental world of one."""
    env = _env_world_size()
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError("parts.partition: a process group was given but torch.distributed "
                               "is not initialised")
        if env > 1:
            raise RuntimeError(f"parts.partition: WORLD_SIZE={env} in the environment but "
                               "torch.distributed is not initialised; every rank would hold the "
                               "whole model. Call torch.distributed.init_process_group first.")
        return GroupInfo(None, 0, 1)
    handle = dist.group.WORLD if group is None else group
    if handle is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(handle) < 0:
        raise ValueError(f"parts.partition: rank {dist.get_rank()} is not a member of the process "
                         "group passed as `group`; only the ranks of a group may shard over it")
    size = dist.get_world_size(handle)
    if size == 1 and env > 1 and handle is dist.group.WORLD:
        raise RuntimeError(f"parts.partition: the default process group has one rank but "
                           f"WORLD_SIZE={env}; every rank would hold the whole model")
    return GroupInfo(handle, dist.get_rank(handle), size)


class Work:
    """A finished (or local) collective: ``wait()`` returns at once."""

    def wait(self) -> bool:
        """Nothing to wait for."""
        return True


def _run_many(collective: Any, outs: list, ins: list, info: GroupInfo, async_op: bool) -> Any:
    """``collective(out, inp)`` per pair, issued back to back (the backend runs them in order);
    a world of one copies. A ``WorkList`` if ``async_op``, else None once all are done."""
    if info.world_size == 1:
        for o, i in zip(outs, ins):
            o.copy_(i)
        return Work() if async_op else None
    works = WorkList([collective(o, i, group=info.group, async_op=True) for o, i in zip(outs, ins)],
                     (outs, ins))
    if async_op:
        return works
    works.wait()
    return None


def all_gather_many(outs: list[torch.Tensor], ins: list[torch.Tensor], info: GroupInfo,
                    async_op: bool = False) -> Any:
    """All-gather every ``ins[k]`` straight into ``outs[k]`` (no packing); counted as one call."""
    comm_counter.allgather_calls += 1
    comm_counter.allgather_bytes += sum(o.numel() * o.element_size() for o in outs)
    return _run_many(all_gather_direct, outs, ins, info, async_op)


def reduce_scatter_many(outs: list[torch.Tensor], ins: list[torch.Tensor], info: GroupInfo,
                        async_op: bool = False, average: bool = False) -> Any:
    """Sum (or with ``average`` mean) every ``ins[k]`` over ranks, this rank's chunk into
    ``outs[k]``; counted as one call.

    ``ins`` may be overwritten (by backends that reduce in place: see ``parts._compat``).
    """
    comm_counter.reduce_scatter_calls += 1
    comm_counter.reduce_scatter_bytes += sum(i.numel() * i.element_size() for i in ins)
    divide_by = info.world_size if average else 1
    collective = partial(reduce_scatter_consuming, op=dist.ReduceOp.SUM, divide_by=divide_by)
    return _run_many(collective, outs, ins, info, async_op)


def broadcast(tensor: torch.Tensor, src: int, info: GroupInfo) -> None:
    """Broadcast ``tensor`` in place from group rank ``src``."""
    comm_counter.broadcast_calls += 1
    comm_counter.broadcast_bytes += tensor.numel() * tensor.element_size()
    if info.world_size == 1 or tensor.numel() == 0:
        return
    dist.broadcast(tensor, src=info.global_rank(src), group=info.group)


def broadcast_object(obj: Optional[object], src: int, info: GroupInfo) -> object:
    """Broadcast a picklable object from group rank ``src``; returns it on every rank."""
    if info.world_size == 1:
        return obj
    return comm_objects.broadcast_object(obj, src, info.group)
