"""Collective algorithms for gloo that beat its own (the bytes of the collective they replace).

gloo's reduce-scatter is slower than its all-reduce of the same tensor (it blocks the
caller while it copies: 8 MB fp32 at world 2, 15.8 ms of which 7.4 ms blocking, against
10.0 ms and 0.1 ms for an all-reduce), and the all-reduce moves twice the bytes. So on
gloo ``reduce_scatter_consuming`` sums by a direct exchange: every rank sends each other
rank that rank's chunk and adds up the chunks it receives (the bytes of a reduce-scatter;
8 MB at world 2 with page faults on fresh memory: 7.6 ms of CPU against 13.3 ms for the
all-reduce and slice, 4.7 against 7.5 ms without).
gloo's all-gather receives into a fresh flat buffer and then copies it out; when fresh
pages cost page faults (freed large blocks returned to the OS) that doubles its CPU time
(4 MB shard at world 2: 10.5 ms against 4.9 ms for one broadcast per rank straight into
the output), so ``all_gather_direct`` broadcasts there: the same bytes on the wire.
Because the direct exchange adds the chunks on receipt, its input may be narrower than its
output (bf16 grads, fp32 sums: ``MixedPrecision``): the chunks travel in the input's dtype
and are added in the output's, the same sums bitwise as casting the whole input up first
(a widening cast is exact), with half the bytes and no full-size fp32 copy.
Other backends use torch's collectives (a narrower input is cast up first), and so does gloo
inside ``parts.comm.device.torch_algorithms()``.
Nothing here counts bytes (``collectives`` does).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from parts._compat import all_gather_flat, reduce_scatter_flat
from parts.comm.device import gloo_algorithms
from parts.comm.work import Waitable, WorkList, finish


def all_gather_direct(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                      async_op: bool = False) -> Optional[Waitable]:
    """``all_gather_flat`` writing straight into ``output`` (on gloo: one broadcast per rank)."""
    if not gloo_algorithms(group):
        return all_gather_flat(output, input, group=group, async_op=async_op)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = output.view(world, -1)
    chunks[rank].copy_(input)
    work = WorkList([dist.broadcast(chunks[r], src=_global_rank(group, r), group=group, async_op=True)
                     for r in range(world) if chunks.shape[1]])
    return finish(work, async_op)


def _global_rank(group: Optional[dist.ProcessGroup], rank: int) -> int:
    """The global rank of ``rank`` in ``group`` (the default group: itself)."""
    return rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, rank)


def sums_on_receipt(op: Any = dist.ReduceOp.SUM, group: Optional[dist.ProcessGroup] = None) -> bool:
    """True when ``reduce_scatter_consuming`` adds the received chunks itself (gloo, a sum), so
    its input travels in its own dtype even when the output is wider."""
    return gloo_algorithms(group) and op == dist.ReduceOp.SUM


def reduce_scatter_consuming(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                             group: Optional[dist.ProcessGroup] = None, async_op: bool = False,
                             divide_by: int = 1) -> Any:
    """``reduce_scatter_flat``, then ``output`` divided by ``divide_by``; ``input`` may be
    overwritten, and may be narrower than ``output`` (summed in ``output``'s dtype). On gloo a
    sum is a direct exchange of chunks (``_exchange_sum``), other ops an all-reduce of
    ``input`` and a slice."""
    if input.dtype != output.dtype and not sums_on_receipt(op, group):
        input = input.to(output.dtype)  # the reduction itself must run in the output's dtype
    if not gloo_algorithms(group):
        work = reduce_scatter_flat(output, input, op=op, group=group, async_op=True)
        work = _SliceWhenDone(work, output, output, divide_by)
    elif op == dist.ReduceOp.SUM:
        work = _exchange_sum(output, input, group, divide_by)
    else:
        chunk = input.view(dist.get_world_size(group), -1)[dist.get_rank(group)]
        work = _SliceWhenDone(dist.all_reduce(input, op=op, group=group, async_op=True), output, chunk, divide_by)
    return finish(work, async_op)


def _exchange_sum(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup], divide_by: int) -> Any:
    """Send every other rank its chunk of ``input``, receive this rank's chunk from each (the
    first straight into ``output`` when the dtypes agree); the handle sums them in rank order
    in ``output``'s dtype, then divides."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = input.view(world, -1)
    peers = [r for r in range(world) if r != rank]
    if chunks.shape[1] == 0 or not peers:
        return _SliceWhenDone(WorkList([]), output, chunks[rank], divide_by)
    direct = input.dtype == output.dtype
    terms = [chunks[r] if r == rank else output if direct and r == peers[0] else torch.empty_like(chunks[r])
             for r in range(world)]
    works = [dist.isend(chunks[r], _global_rank(group, r), group=group) for r in peers]
    works += [dist.irecv(terms[r], _global_rank(group, r), group=group) for r in peers]
    return _SumWhenDone(WorkList(works), output, terms, divide_by)


class _SumWhenDone:
    """Point-to-point transfers whose ``wait()`` then sums ``terms`` into ``output`` (once)."""

    def __init__(self, work: Any, output: torch.Tensor, terms: list, divide_by: int) -> None:
        self._work, self._output, self._terms, self._divide_by = work, output, terms, divide_by

    def wait(self) -> bool:
        """Wait for the transfers, then add the terms in rank order (and divide)."""
        if self._work is not None:
            self._work.wait()
            first, second, *rest = self._terms  # ``output`` is one of the first two, or no term
            if first.dtype == self._output.dtype:
                torch.add(first, second, out=self._output)
            else:  # narrower terms: cast up exactly, add in the output's dtype
                self._output.copy_(first)
                self._output.add_(second)
            for term in rest:
                self._output.add_(term)
            if self._divide_by != 1:
                self._output.div_(self._divide_by)
            self._work = self._terms = None
        return True


class _SliceWhenDone:
    """A reduction whose ``wait()`` then writes ``chunk / divide_by`` into ``output`` (once)."""

    def __init__(self, work: Any, output: torch.Tensor, chunk: torch.Tensor, divide_by: int) -> None:
        self._work, self._output, self._chunk, self._divide_by = work, output, chunk, divide_by

    def wait(self) -> bool:
        """Wait for the collective, then copy (and divide) the chunk."""
        if self._work is not None:
            self._work.wait()
            chunk = self._chunk
            if chunk.dtype != self._output.dtype:  # a narrower input: cast up (exact) before dividing
                self._output.copy_(chunk)
                chunk = self._output
            if self._divide_by != 1:
                torch.div(chunk, self._divide_by, out=self._output)
            elif chunk is not self._output:
                self._output.copy_(chunk)
            self._work = self._chunk = None
        return True
