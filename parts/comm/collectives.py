"""The collectives every part builds on, each counted in ``comm_counter``.

All take a ``GroupInfo`` (``parts.comm.group``); a world of one copies locally and issues
nothing. Flat all-gathers and reduce-scatters go through the gloo algorithms of
``parts.comm.gloo`` (torch's own collective on other backends).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from parts._compat import all_gather_flat, reduce_scatter_flat
from parts.comm.counter import comm_counter, wire_bytes
from parts.comm.device import comm_device, to_host
from parts.comm.gloo import all_gather_direct, reduce_scatter_consuming, sums_on_receipt
from parts.comm.group import GroupArg, GroupInfo, group_info, is_distributed
from parts.comm.packed import FinishAfter, PackedAllGather, PackedReduceScatter, split_small
from parts.comm.topology import two_hop_all_gather
from parts.comm.work import Waitable, Work, WorkList, finish

ReduceOp = dist.ReduceOp
"""The reduction ops (``ReduceOp.SUM``, ``MAX``, ``MIN``, ...)."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def group_key(info: GroupInfo) -> str:
    """The ledger key of a group in ``comm_counter.by_group()``: its members' global ranks
    ("0,1,2,3"), "local" for a world of one."""
    if info.world_size == 1:
        return "local"
    return ",".join(map(str, info.global_ranks()))


def _count(kind: str, nbytes: int, info: GroupInfo) -> None:
    comm_counter.add(kind, nbytes, group=group_key(info))


def _run_many(collective: Callable, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor],
              info: GroupInfo, async_op: bool) -> Optional[Waitable]:
    """``collective(out, inp)`` per pair, issued back to back (the backend runs them in order);
    a world of one copies. A ``WorkList`` if ``async_op``, else None once all are done."""
    if info.world_size == 1:
        for o, i in zip(outs, ins):
            o.copy_(i)
        return Work() if async_op else None
    works = WorkList([collective(o, i, group=info.group, async_op=True) for o, i in zip(outs, ins)],
                     (outs, ins))
    return finish(works, async_op)


def _packing(collective: Callable, packer: type, outs: Sequence[torch.Tensor],
             ins: Sequence[torch.Tensor], chunks: Sequence[torch.Tensor], info: GroupInfo,
             async_op: bool) -> Optional[Waitable]:
    """The small pairs (by their per-rank ``chunks``) in one packed collective, the others
    straight; one handle for all, whose ``wait()`` also unpacks (``parts.comm.packed``).
    Pairs pack together only if both their dtypes agree."""
    kinds = [(o.dtype, i.dtype) for o, i in zip(outs, ins)]
    packed, direct = split_small([c.numel() for c in chunks], kinds)
    if not packed or info.world_size == 1:
        return _run_many(collective, outs, ins, info, async_op)
    pack = packer([outs[i] for i in packed], [ins[i] for i in packed], info.world_size)
    works = [FinishAfter(_run_many(collective, [pack.recv], [pack.send], info, True), pack.finish)]
    if direct:
        works.append(_run_many(collective, [outs[i] for i in direct], [ins[i] for i in direct], info, True))
    return finish(WorkList(works), async_op)


def all_gather_many(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], info: GroupInfo,
                    async_op: bool = False) -> Optional[Waitable]:
    """All-gather every ``ins[k]`` into ``outs[k]``, counted as one call: large ones straight
    into ``outs[k]``, small ones packed into one flat collective (``parts.comm.packed``); over
    a group with a topology, in two hops (``parts.comm.topology``)."""
    if info.topology is not None and info.world_size > 1:
        return finish(WorkList([_two_hop_many(outs, ins, info, dtype)
                                for dtype in dict.fromkeys(i.dtype for i in ins)]), async_op)
    _count("allgather", wire_bytes(sum(_nbytes(i) for i in ins), info.world_size), info)
    return _packing(all_gather_direct, PackedAllGather, outs, ins, ins, info, async_op)


def _hop(out: torch.Tensor, inp: torch.Tensor, sub: GroupInfo, async_op: bool) -> Optional[Waitable]:
    _count("allgather", wire_bytes(_nbytes(inp), sub.world_size), sub)
    return _run_many(all_gather_direct, [out], [inp], sub, async_op)


def _two_hop_many(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], info: GroupInfo,
                  dtype: torch.dtype) -> Waitable:
    """The pairs of ``dtype`` packed into one two-hop all-gather; ``wait()`` unpacks them."""
    pairs = [(o, i) for o, i in zip(outs, ins) if i.dtype == dtype]
    sizes = [i.numel() for _, i in pairs]
    send = torch.cat([i.reshape(-1) for _, i in pairs])
    recv = torch.empty(info.world_size * send.numel(), dtype=dtype, device=send.device)
    hops = two_hop_all_gather(recv, send, info.topology, _hop, True)

    def unpack() -> None:
        rows = recv.view(info.world_size, -1)
        torch.split_with_sizes_copy(rows, sizes, dim=1, out=[o.view(info.world_size, -1) for o, _ in pairs])

    return FinishAfter(hops, unpack)


def reduce_scatter_many(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], info: GroupInfo,
                        async_op: bool = False, average: bool = False) -> Optional[Waitable]:
    """Sum (or with ``average`` mean) every ``ins[k]`` over ranks, this rank's chunk into
    ``outs[k]``; counted as one call, small ones packed into one flat collective.
    ``ins`` may be overwritten, and narrower than ``outs`` (the sums run in ``outs``' dtype;
    on gloo the chunks travel narrow: see ``parts.comm.gloo``). Over a group with a topology,
    in two hops (within the node, then across: each piece crosses between nodes once)."""
    if info.topology is not None and info.world_size > 1:
        kinds = dict.fromkeys((i.dtype, o.dtype) for o, i in zip(outs, ins))
        return finish(WorkList([_two_hop_reduce(outs, ins, info, kind, average) for kind in kinds]), async_op)
    narrow = info.world_size > 1 and sums_on_receipt(dist.ReduceOp.SUM, info.group)
    chunk_bytes = sum(o.numel() * (i if narrow else o).element_size() for o, i in zip(outs, ins))
    _count("reduce_scatter", wire_bytes(chunk_bytes, info.world_size), info)
    divide_by = info.world_size if average else 1
    collective = partial(reduce_scatter_consuming, op=dist.ReduceOp.SUM, divide_by=divide_by)
    return _packing(collective, PackedReduceScatter, outs, ins, outs, info, async_op)


def _two_hop_reduce(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], info: GroupInfo,
                    kind: tuple, average: bool) -> Waitable:
    """The pairs of ``kind`` (input and output dtype) as one two-hop reduce-scatter: the pieces
    laid out by local rank, reduce-scattered within the node (every local rank then holds its
    pieces of every node, summed over the node), then across nodes; ``wait()`` unpacks."""
    topo = info.topology
    pairs = [(o, i) for o, i in zip(outs, ins) if (i.dtype, o.dtype) == kind]
    sizes = [o.numel() for o, _ in pairs]
    total = sum(sizes)
    by_local = torch.empty(topo.per_node * topo.nodes * total, dtype=kind[0], device=pairs[0][1].device)
    view, off = by_local.view(topo.per_node, topo.nodes, total), 0
    for (o, i), n in zip(pairs, sizes):  # group rank node * per_node + local -> [local, node]
        view[:, :, off:off + n].copy_(i.reshape(topo.nodes, topo.per_node, n).transpose(0, 1))
        off += n
    node_sums = torch.empty(topo.nodes * total, dtype=kind[1], device=by_local.device)
    first = reduce_scatter_many([node_sums], [by_local], topo.node, async_op=True)

    def across() -> None:
        mine = torch.empty(total, dtype=kind[1], device=by_local.device)
        reduce_scatter_many([mine], [node_sums], topo.across)
        if average:
            mine.div_(info.world_size)
        torch.split_with_sizes_copy(mine, sizes, out=[o.view(-1) for o, _ in pairs])

    return FinishAfter(first, across)


def all_gather(out: torch.Tensor, inp: torch.Tensor, info: GroupInfo, *, direct: bool = False) -> None:
    """Every rank's equal-size 1-D ``inp`` into ``out``, in rank order; ``direct``: straight into
    ``out`` on gloo (``parts.comm.gloo.all_gather_direct``), else torch's all-gather."""
    if info.world_size == 1 or not direct:
        _count("allgather", wire_bytes(_nbytes(inp), info.world_size), info)
        if info.world_size == 1:
            out.copy_(inp)
        else:
            all_gather_flat(out, inp, group=info.group)
        return
    all_gather_many([out], [inp], info)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, info: GroupInfo, *, consume: bool = False,
                   average: bool = False) -> None:
    """This rank's chunk of the sum (or mean) over ranks of ``inp`` into ``out``. ``consume``:
    ``inp`` may be overwritten (gloo's direct exchange), else torch's reduce-scatter."""
    if consume:
        reduce_scatter_many([out], [inp], info, average=average)
        return
    _count("reduce_scatter", wire_bytes(_nbytes(out), info.world_size), info)
    if info.world_size == 1:
        out.copy_(inp)
    else:
        reduce_scatter_flat(out, inp, op=ReduceOp.SUM, group=info.group)
    if average:
        out.div_(info.world_size)


def all_reduce(t: torch.Tensor, info: GroupInfo, op: ReduceOp.RedOpType = ReduceOp.SUM) -> torch.Tensor:
    """``t`` reduced over the group in place (returned); counted as a reduce-scatter plus an all-gather."""
    _count("all_reduce", 2 * wire_bytes(_nbytes(t), info.world_size) // max(info.world_size, 1), info)
    if info.world_size > 1:
        dist.all_reduce(t, op=op, group=info.group)
    return t


def same_everywhere(code: int, info: GroupInfo) -> bool:
    """True if the integer ``code`` is the same on every rank of the group: one all-reduce of
    ``(code, -code)`` with MAX, counted as a ``check`` (not model traffic)."""
    both = torch.tensor([code, -code], dtype=torch.int64, device=comm_device(info))
    _count("check", 2 * wire_bytes(_nbytes(both), info.world_size) // max(info.world_size, 1), info)
    if info.world_size > 1:
        dist.all_reduce(both, op=ReduceOp.MAX, group=info.group)
    return int(both[0]) == -int(both[1])


def max_everywhere(values: list[int], info: GroupInfo) -> list[int]:
    """The element-wise maximum of the int64 ``values`` over the group: one all-reduce, counted as
    a ``check`` (not model traffic)."""
    t = torch.tensor(values, dtype=torch.int64, device=comm_device(info))
    _count("check", 2 * wire_bytes(_nbytes(t), info.world_size) // max(info.world_size, 1), info)
    if info.world_size > 1:
        dist.all_reduce(t, op=ReduceOp.MAX, group=info.group)
    return to_host(t).tolist()


def all_reduce_async(t: torch.Tensor, info: GroupInfo, op: ReduceOp.RedOpType = ReduceOp.SUM) -> Waitable:
    """``all_reduce`` issued without waiting: ``t`` holds the result once the handle's ``wait()``
    returned (the handle keeps ``t`` alive until then); counted as ``all_reduce``."""
    _count("all_reduce", 2 * wire_bytes(_nbytes(t), info.world_size) // max(info.world_size, 1), info)
    if info.world_size == 1:
        return Work()
    return WorkList([dist.all_reduce(t, op=op, group=info.group, async_op=True)], (t,))


def broadcast(tensor: torch.Tensor, src: int, info: GroupInfo) -> None:
    """Broadcast ``tensor`` in place from group rank ``src``."""
    _count("broadcast", _nbytes(tensor) if info.world_size > 1 else 0, info)
    if info.world_size == 1 or tensor.numel() == 0:
        return
    dist.broadcast(tensor, src=info.global_rank(src), group=info.group)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
               info: GroupInfo, async_op: bool = False) -> Optional[Waitable]:
    """Send ``inp``'s consecutive pieces of ``in_splits`` elements to ranks 0, 1, ... and receive
    theirs into ``out`` (pieces of ``out_splits``): one batched exchange, counted as the bytes
    sent to the other ranks. With ``async_op`` a handle (keeping both alive until ``wait()``)."""
    size = inp.element_size()
    _count("all_to_all", (sum(in_splits) - in_splits[info.rank]) * size if info.world_size > 1 else 0, info)
    if info.world_size == 1:
        out.copy_(inp)
        return Work() if async_op else None
    work = dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=info.group, async_op=True)
    return finish(WorkList([work], (out, inp)), async_op)


def all_gather_list(x: torch.Tensor, info: GroupInfo) -> list[torch.Tensor]:
    """Every rank's ``x`` (same shape everywhere) as a list in rank order (``x`` itself alone)."""
    if info.world_size == 1:
        return [x]
    _count("allgather", wire_bytes(_nbytes(x), info.world_size), info)
    out = [torch.empty_like(x) for _ in range(info.world_size)]
    dist.all_gather(out, x, group=info.group)
    return out


def new_group(ranks: Sequence[int]) -> dist.ProcessGroup:
    """A new process group of the global ``ranks`` (every rank of the world must call it, in the same order)."""
    return dist.new_group(ranks=list(ranks))


def min_max(values: torch.Tensor, group: GroupArg = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise minimum and maximum of ``values`` over ``group``; local copies when not distributed."""
    if not is_distributed():
        return values.clone(), values.clone()
    info = group_info(group, "min_max(group=...)")
    device = comm_device(info)
    lo, hi = values.to(device, copy=True), values.to(device, copy=True)
    all_reduce(lo, info, ReduceOp.MIN)
    all_reduce(hi, info, ReduceOp.MAX)
    return to_host(lo), to_host(hi)
