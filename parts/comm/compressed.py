"""Compressed collectives: blockwise int8 / int4 codes and fp32 scales on the wire (``quantize``).

* ``all_gather_quantized``: each rank quantizes its own shard (blocks restart at the shard,
  so the result is bitwise the gather of the full-precision shards quantized apart), the
  codes and scales are all-gathered as bytes (gloo refuses float8 but carries uint8), every
  rank dequantizes every rank's chunk into the output's dtype: all ranks hold the same values.
  Over a group with a topology both hops carry the codes (each byte crosses between nodes
  once; the node hop forwards what crossed, so nothing is quantized twice). ``keep`` receives
  the gathered codes of every piece (all ranks' rows), for a later gather of them.
* ``all_gather_rows``: rows of codes already made (a node's share of such a gather, kept)
  all-gathered as they are and dequantized: the values the first gather gave, bitwise.
* ``reduce_scatter_quantized``: each rank quantizes the chunk it sends each peer (plus that
  chunk's error-feedback residual), the chunks go by a direct exchange (one send and one
  receive per peer), and each rank sums, in fp32 and rank order, the dequantized chunks it
  received and its own chunk exactly (it never travels). Over a group with a topology in two
  hops, within the node then across, with a codec per hop (``node_codec=None``: the node hop
  in full precision, ZeRO++'s shape: only the slow hop is compressed).
* ``all_reduce_mean_quantized``: each tensor (a parameter's grad shard) cut into one chunk
  per rank, a compressed reduce-scatter of the chunks, then the owner of each chunk quantizes
  the mean (with a residual of its own) and the codes are all-gathered; every rank, the owner
  too, reads back the dequantized mean, so every member ends with the same bits. Blocks and
  residuals are per tensor, so the result does not depend on how tensors are bucketed
  together (one call for all, one per tensor, a bucket read from disk).

Bytes are counted in ``comm_counter`` as what travels (codes, scales and the few bytes that
align each rank's row to 4), with the counter's convention per kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import torch
import torch.distributed as dist

from parts.comm.collectives import group_key, reduce_scatter_many
from parts.comm.counter import comm_counter, wire_bytes
from parts.comm.gloo import all_gather_direct
from parts.comm.group import GroupInfo
from parts.comm.packed import FinishAfter
from parts.comm.quantize import ErrorFeedback, Quantized, code_bytes, dequantize, num_blocks, quantize
from parts.comm.topology import two_hop_all_gather
from parts.comm.work import Waitable, Work, WorkList, finish


@dataclass(frozen=True)
class Codec:
    """How a collective quantizes: ``bits`` (8 or 4) and ``block`` (elements per fp32 scale)."""

    bits: int = 8
    block: int = 256


def row_bytes(numels: Sequence[int], codec: Codec) -> int:
    """Bytes of one rank's row on the wire for pieces of ``numels`` elements: the scales, the
    codes, and zeros up to a multiple of 4 (so every row's scales can be read as fp32)."""
    raw = sum(4 * num_blocks(n, codec.block) + code_bytes(n, codec.bits) for n in numels)
    return -(-raw // 4) * 4


def gather_bytes(numels: Sequence[int], world_size: int, codec: Codec) -> int:
    """Bytes one rank receives in ``all_gather_quantized`` of pieces of ``numels`` elements per
    rank over ``world_size`` ranks (the counter's convention: ``world_size - 1`` rows)."""
    return (world_size - 1) * row_bytes(numels, codec)


def gather_shares(numels: Sequence[int], world_size: int, codec: Codec) -> list[int]:
    """Each piece's share of ``gather_bytes(numels, ...)``: its scales and codes, the row's
    alignment counted on the last piece (so the shares sum to the gather's bytes)."""
    shares = [(world_size - 1) * (4 * num_blocks(n, codec.block) + code_bytes(n, codec.bits)) for n in numels]
    if shares:
        shares[-1] += gather_bytes(numels, world_size, codec) - sum(shares)
    return shares


def to_wire(qs: Sequence[Quantized]) -> torch.Tensor:
    """The pieces' scales then codes, row by row, as one (rows, ``row_bytes``) uint8 tensor."""
    rows = qs[0].scales.shape[0]
    codec = Codec(qs[0].bits, qs[0].block)
    wire = torch.zeros(rows, row_bytes([q.numel for q in qs], codec), dtype=torch.uint8, device=qs[0].scales.device)
    scales = torch.cat([q.scales for q in qs], 1).view(torch.uint8)
    codes = torch.cat([q.codes.view(torch.uint8) for q in qs], 1)
    wire[:, :scales.shape[1]] = scales
    wire[:, scales.shape[1]:scales.shape[1] + codes.shape[1]] = codes
    return wire


def from_wire(wire: torch.Tensor, numels: Sequence[int], codec: Codec) -> list[Quantized]:
    """The pieces of ``numels`` elements read back from (rows, ``row_bytes``) ``wire``."""
    blocks = [num_blocks(n, codec.block) for n in numels]
    nscale = 4 * sum(blocks)
    scales = wire[:, :nscale].contiguous().reshape(-1).view(torch.float32).view(wire.shape[0], -1 if nscale else 0)
    scales = scales.split(blocks, 1)
    codes = wire[:, nscale:nscale + sum(code_bytes(n, codec.bits) for n in numels)]
    codes = codes.split([code_bytes(n, codec.bits) for n in numels], 1)
    return [Quantized(c.view(torch.int8) if codec.bits == 8 else c, s, n, codec.block, codec.bits)
            for c, s, n in zip(codes, scales, numels)]


def _count(kind: str, nbytes: int, info: GroupInfo) -> None:
    comm_counter.add(kind, nbytes, group=group_key(info))


def _gather_hop(out: torch.Tensor, inp: torch.Tensor, sub: GroupInfo, async_op: bool) -> Optional[Waitable]:
    _count("allgather", wire_bytes(inp.numel(), sub.world_size), sub)
    return all_gather_direct(out, inp, sub.group, async_op=async_op)


def _all_gather_bytes(recv: torch.Tensor, send: torch.Tensor, info: GroupInfo, kind: str) -> Waitable:
    """All-gather the uint8 ``send`` of every rank into ``recv`` (two hops over a topology)."""
    if info.world_size == 1:
        recv.copy_(send)
        return Work()
    if info.topology is not None:
        return two_hop_all_gather(recv, send, info.topology, _gather_hop, True)
    _count(kind, wire_bytes(send.numel(), info.world_size), info)
    return all_gather_direct(recv, send, info.group, async_op=True)


@torch.no_grad()
def all_gather_quantized(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], info: GroupInfo,
                         codec: Codec, async_op: bool = False,
                         keep: Optional[list[Quantized]] = None) -> Optional[Waitable]:
    """Every rank's 1-D ``ins[k]`` (any float dtype) quantized, gathered as codes and scales and
    dequantized into ``outs[k]`` (``world * len(ins[k])`` elements, rank order, ``outs[k]``'s dtype);
    ``keep`` (a list) gets each piece's codes of every rank (views of the received bytes)."""
    world = info.world_size
    send = to_wire([quantize(i.reshape(1, -1), codec.block, codec.bits) for i in ins]).view(-1)
    recv = torch.empty(world * send.numel(), dtype=torch.uint8, device=send.device)
    work = _all_gather_bytes(recv, send, info, "allgather")
    numels = [i.numel() for i in ins]

    def unpack() -> None:
        pieces = from_wire(recv.view(world, -1), numels, codec)
        for out, q in zip(outs, pieces):
            dequantize(q, out=out.view(world, -1))  # straight into the output, cast as stored
        if keep is not None:
            keep.extend(pieces)

    return finish(FinishAfter(work, unpack), async_op)


@torch.no_grad()
def all_gather_rows(outs: Sequence[torch.Tensor], rows: Sequence[torch.Tensor], numels: Sequence[int],
                    info: GroupInfo, codec: Codec, async_op: bool = False) -> Optional[Waitable]:
    """Each member's ``rows[k]`` ((r, ``row_bytes([numels[k]])``) uint8: ``to_wire`` rows of
    ``numels[k]`` elements, the same ``r`` on every member) gathered in member order and
    dequantized into ``outs[k]`` (``world * r * numels[k]`` elements, ``outs[k]``'s dtype)."""
    world, r = info.world_size, rows[0].shape[0]
    widths = [x.shape[1] for x in rows]
    send = torch.cat(list(rows), 1).reshape(-1)
    recv = torch.empty(world * send.numel(), dtype=torch.uint8, device=send.device)
    work = _all_gather_bytes(recv, send, info, "allgather")

    def unpack() -> None:
        for out, piece, n in zip(outs, recv.view(world * r, -1).split(widths, 1), numels):
            dequantize(from_wire(piece, [n], codec)[0], out=out.view(world * r, -1))

    return finish(FinishAfter(work, unpack), async_op)


def _compensated(rows: torch.Tensor, key: Hashable, codec: Codec, ef: Optional[ErrorFeedback],
                 own: Optional[int]) -> tuple[Quantized, torch.Tensor]:
    if ef is None:
        t = rows.float()
        return quantize(t, codec.block, codec.bits), t
    return ef.compensate(key, rows, codec.block, codec.bits, exact_row=own)


@torch.no_grad()
def _reduce_rows(outs: Sequence[torch.Tensor], rows: Sequence[torch.Tensor], info: GroupInfo, codec: Codec,
                 ef: Optional[ErrorFeedback], keys: Sequence[Hashable], divide_by: int, kind: str) -> Waitable:
    """Row ``r`` of every ``rows[k]`` (world, n_k) summed over ranks into rank ``r``'s ``outs[k]``
    (n_k): rows sent as codes by a direct exchange, summed in fp32 in rank order, this rank's
    own row exactly; divided by ``divide_by``."""
    world, rank = info.world_size, info.rank
    sent = [_compensated(r, k, codec, ef, rank) for r, k in zip(rows, keys)]
    send = to_wire([q for q, _ in sent])
    recv = send.clone() if world == 1 else torch.empty_like(send)
    works = []
    if world > 1:
        _count(kind, wire_bytes(send.shape[1], world), info)
        peers = [r for r in range(world) if r != rank]
        works = [dist.isend(send[r], info.global_rank(r), group=info.group) for r in peers]
        works += [dist.irecv(recv[r], info.global_rank(r), group=info.group) for r in peers]
        recv[rank] = send[rank]
    numels = [r.shape[1] for r in rows]

    def total() -> None:
        for out, q, (_, t) in zip(outs, from_wire(recv, numels, codec), sent):
            values = dequantize(q)
            values[rank] = t[rank]
            acc = values[0].clone()
            for r in range(1, world):
                acc.add_(values[r])
            out.copy_(acc.div_(divide_by) if divide_by != 1 else acc)

    return FinishAfter(WorkList(works, (send, recv)), total)


def reduce_scatter_quantized(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], info: GroupInfo,
                             codec: Codec, *, keys: Sequence[Hashable], ef: Optional[ErrorFeedback] = None,
                             node_codec: Optional[Codec] = None, average: bool = False,
                             async_op: bool = False) -> Optional[Waitable]:
    """Sum (or mean) over ranks of every 1-D ``ins[k]`` (``world * len(outs[k])``, any float
    dtype), this rank's chunk into ``outs[k]``; each piece compensated by ``ef``'s residual
    under ``keys[k]`` (one key per piece and hop). Over a topology, two hops: ``node_codec``
    within the node (None: full precision), ``codec`` across."""
    divide_by = info.world_size if average else 1
    if info.topology is None or info.world_size == 1:
        rows = [i.view(info.world_size, -1) for i in ins]
        return finish(_reduce_rows(outs, rows, info, codec, ef, keys, divide_by, "reduce_scatter"), async_op)
    topo = info.topology
    nodes, local = topo.nodes, topo.per_node
    by_local = [i.view(nodes, local, o.numel()).transpose(0, 1).reshape(local, -1) for o, i in zip(outs, ins)]
    sums = [torch.empty(nodes * o.numel(), dtype=torch.float32, device=o.device) for o in outs]
    if node_codec is None:
        first = reduce_scatter_many(sums, [b.reshape(-1) for b in by_local], topo.node, async_op=True)
    else:
        first = _reduce_rows(sums, by_local, topo.node, node_codec, ef, [(k, "node") for k in keys], 1,
                             "reduce_scatter")

    def across() -> None:
        rows = [s.view(nodes, -1) for s in sums]
        _reduce_rows(outs, rows, topo.across, codec, ef, [(k, "across") for k in keys], divide_by,
                     "reduce_scatter").wait()

    return finish(FinishAfter(first, across), async_op)


@torch.no_grad()
def all_reduce_mean_quantized(ts: Sequence[torch.Tensor], info: GroupInfo, codec: Codec,
                              ef: Optional[ErrorFeedback], keys: Sequence[Hashable],
                              async_op: bool = False) -> Optional[Waitable]:
    """Every 1-D fp32 ``ts[k]`` replaced in place by its mean over the group, reduced as codes in
    both phases (residuals under ``(keys[k], "in")`` and ``(keys[k], "out")``); every member gets
    the same bits. ``async_op``: the reduce-scatter phase is issued at once and the handle's
    ``wait()`` finishes it and runs the all-gather phase."""
    world = info.world_size
    if world == 1:
        return finish(Work(), async_op)
    chunks = [-(-t.numel() // world) for t in ts]
    padded = [torch.zeros(world * c, dtype=torch.float32, device=t.device) for t, c in zip(ts, chunks)]
    for p, t in zip(padded, ts):
        p[:t.numel()] = t
    mine = [torch.empty(c, dtype=torch.float32, device=t.device) for t, c in zip(ts, chunks)]
    first = _reduce_rows(mine, [p.view(world, c) for p, c in zip(padded, chunks)], info, codec, ef,
                         [(k, "in") for k in keys], world, "all_reduce")

    @torch.no_grad()
    def gather_mean() -> None:
        qs = [_compensated(m.view(1, -1), (k, "out"), codec, ef, None)[0] for m, k in zip(mine, keys)]
        send = to_wire(qs).view(-1)
        recv = torch.empty(world * send.numel(), dtype=torch.uint8, device=send.device)
        _all_gather_bytes(recv, send, info, "all_reduce").wait()
        for t, q in zip(ts, from_wire(recv.view(world, -1), chunks, codec)):
            t.copy_(dequantize(q).view(-1)[:t.numel()])

    return finish(FinishAfter(first, gather_mean), async_op)
