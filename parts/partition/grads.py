"""Full gradients to gradient shards (one coalesced reduce-scatter), and ``shards``.

``reduce_scatter_grads`` casts every full ``p.grad`` into one flat send buffer of
``dtype`` (fp32 by default, whatever the param dtype), laid out rank-major with the
padding zeroed, reduce-scatters it (sum), divides by the group size when ``average``
(DDP semantics) and adds the result into ``meta(p).grad_shard`` (or overwrites it when
``accumulate=False``). Params whose ``.grad`` is None are skipped: every rank must pass
the same params with the same None pattern, or the collective sizes disagree.

``shards`` returns the shard tensors themselves; when a grad shard has the shard's dtype
and device it *is* ``shard.grad``, so ``torch.optim.AdamW(shards(model))`` steps the
shards, and ``optimizer.zero_grad()`` clears the grad shards. bf16 shards with fp32 grad
shards cannot carry them as ``.grad`` (torch requires equal dtypes): ``shards`` raises
for shards that are not fp32 and names ``BF16Optimizer`` (fp32 master weights).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

from parts.partition._collectives import reduce_scatter_sum
from parts.partition.param import alloc, common_info, internal, is_partitioned, meta, metas_sorted

__all__ = ["ReduceHandle", "reduce_scatter_grads", "shards"]

_FULL_PRECISION = (torch.float32,)


def _send_buffer(pairs: list, dtype: torch.dtype, world: int) -> tuple[torch.Tensor, list[int], int]:
    """Rank-major flat buffer of all grads in ``dtype``, padding zeroed; offsets in one chunk."""
    sizes = [m.layout.shard_numel for _, m in pairs]
    offsets = list(itertools.accumulate([0] + sizes[:-1]))
    chunk = sum(sizes)
    device = pairs[0][1].device
    send = alloc(chunk * world, dtype, device)
    rows = send.view(world, chunk)
    for (p, m), off, n in zip(pairs, offsets, sizes):
        grad = p.grad.detach().reshape(-1).to(dtype)
        if grad.numel() != m.numel:
            raise RuntimeError(f"reduce_scatter_grads: {m.describe()} has a grad of "
                               f"{grad.numel()} elements, expected {m.numel}")
        _scatter_into_rows(rows[:, off:off + n], grad, n)
    return send, offsets, chunk


def _scatter_into_rows(block: torch.Tensor, grad: torch.Tensor, n: int) -> None:
    """Write flat ``grad`` into a (world, n) block row by row, zeroing the padding."""
    full_rows = grad.numel() // n if n else 0
    if full_rows:
        block[:full_rows].copy_(grad[:full_rows * n].view(full_rows, n))
    rest = grad.numel() - full_rows * n
    if full_rows < block.shape[0]:
        block[full_rows, :rest].copy_(grad[full_rows * n:])
        block[full_rows, rest:].zero_()
        block[full_rows + 1:].zero_()


class ReduceHandle:
    """A pending ``reduce_scatter_grads``: ``wait()`` adds the reduced slices into the grad shards."""

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self._work, self._finish = work, finish

    @property
    def done(self) -> bool:
        """True once ``wait()`` has completed."""
        return self._work is None

    @internal
    def wait(self) -> None:
        """Wait for the collective, then accumulate (idempotent)."""
        if self._work is None:
            return
        work, self._work = self._work, None
        work.wait()
        self._finish()


@internal
def reduce_scatter_grads(params: Iterable[nn.Parameter], group: Any = None, *, accumulate: bool = True,
                         dtype: torch.dtype = torch.float32, average: bool = True,
                         async_op: bool = False) -> Optional[ReduceHandle]:
    """Reduce-scatter the full ``p.grad`` of ``params`` into their grad shards (sum or mean), freeing ``p.grad``.

    The grads are copied into the send buffer and freed at once; with ``async_op`` the
    grad shards are updated only by the returned handle's ``wait()``.
    """
    pairs = [(p, m) for p, m in metas_sorted(params) if p.grad is not None]
    info = common_info(pairs, group, "reduce_scatter_grads")
    if not pairs:
        return ReduceHandle(None, lambda: None) if async_op else None
    send, offsets, chunk = _send_buffer(pairs, dtype, info.world_size)
    for p, _ in pairs:
        p.grad = None
    recv = alloc(chunk, dtype, send.device)
    work = reduce_scatter_sum(recv, send, info, async_op=async_op)

    def finish() -> None:
        if average and info.world_size > 1:
            recv.div_(info.world_size)
        for (_, m), off in zip(pairs, offsets):
            _accumulate(m, recv[off:off + m.layout.shard_numel], dtype, accumulate)

    if not async_op:
        del send
        finish()
        return None
    return ReduceHandle(_Pinned(work, send), finish)


class _Pinned:
    """A work handle that keeps its send buffer alive until the collective is done."""

    def __init__(self, work: Any, send: torch.Tensor) -> None:
        self._work, self._send = work, send

    def wait(self) -> None:
        """Wait for the collective, then drop the send buffer."""
        self._work.wait()
        self._send = None


def _accumulate(m: Any, part: torch.Tensor, dtype: torch.dtype, accumulate: bool) -> None:
    """Add (or copy) ``part`` into the grad shard, creating it in ``dtype`` on the shard device."""
    current = m.grad_shard
    if current is None:
        current = alloc(m.layout.shard_numel, dtype, m.shard.device)
        current.copy_(part)
        m.grad_shard = current
    elif accumulate:
        current.add_(part.to(current.device))
    else:
        current.copy_(part)


def shards(module_or_params: Union[nn.Module, Iterable[nn.Parameter]]) -> list[torch.Tensor]:
    """The local shard tensors (leaves whose ``.grad`` is the grad shard) for a torch optimizer."""
    params = (module_or_params.parameters() if isinstance(module_or_params, nn.Module)
              else module_or_params)
    out, seen = [], set()
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if not is_partitioned(p):
            raise TypeError(f"shards: a parameter of shape {tuple(p.shape)} is not partitioned; "
                            f"partition the whole module (partition_module) first")
        m = meta(p)
        g = m.grad_shard
        if m.shard.dtype not in _FULL_PRECISION or (g is not None and g.dtype != m.shard.dtype):
            raise TypeError(f"shards: {m.describe()} has {m.shard.dtype} shards; their fp32 grad "
                            f"shards cannot be attached as .grad (torch needs equal dtypes), so a "
                            f"plain optimizer would silently skip them. Use parts.optim.BF16Optimizer "
                            f"(fp32 master) or step meta(p).shard with meta(p).grad_shard yourself")
        out.append(m.shard)
    return out
