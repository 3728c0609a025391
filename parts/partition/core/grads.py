"""Full gradients to gradient shards (one group of reduce-scatters), and ``shards``.

``reduce_scatter_grads`` reduce-scatters (sum) every full ``p.grad`` in ``dtype`` (fp32 by
default), or in the parameter's own dtype where that is wider (float64 parameters sum and keep
float64 grad shards: ``grad_dtype``): the sums run in that dtype. A grad that ``dtype`` holds
exactly (bf16 grads of a ``MixedPrecision`` gather, fp32 sums) is sent in its own dtype and
cast up chunk by chunk as the collective adds it (on gloo it also travels as bf16: half the
bytes, no full-size fp32 copy of it; ``parts.comm.gloo``); any other is cast to ``dtype``
first. The grad itself is the send buffer when it already is a flat tensor of
``world_size * shard_numel`` elements in the send dtype, else a padded copy (padding zeroed).
It divides by the group size when ``average`` (DDP semantics) and adds the
result into ``meta(p).grad_shard`` (the result becomes the grad shard if there is none;
overwrites it when ``accumulate=False``). Params whose ``.grad`` is None are skipped:
every rank must pass the same params with the same None pattern, or the collectives
disagree.

``shards`` returns the shard tensors themselves; when a grad shard has the shard's dtype
and device it *is* ``shard.grad``, so ``torch.optim.AdamW(shards(model))`` steps the
shards, and ``optimizer.zero_grad()`` clears the grad shards. A shard has its parameter's
``requires_grad`` (a ``requires_grad`` filter over shards leaves out frozen parameters). bf16 shards with fp32 grad
shards cannot carry them as ``.grad`` (torch requires equal dtypes): ``shards`` raises
for shards that are neither fp32 nor float64 and names ``BF16Optimizer`` (fp32 master weights).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

from parts.comm import GroupArg, reduce_scatter_many
from parts.partition.core import disk
from parts.partition.core.compression import compressed_grads, reduce_compressed
from parts.partition.core.grad_guard import follow_requires_grad
from parts.partition.core.param import alloc, common_info, internal, is_partitioned, meta, metas_sorted
from parts.partition.core.replicas import before_landing
from parts.partition.core.steps import watch

_FULL_PRECISION = (torch.float32, torch.float64)


def grad_dtype(param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter's grads are summed and kept in: ``reduce_dtype``, or the parameter's
    floating dtype where that is wider than fp32 (float64 grads are never rounded to fp32)."""
    if param_dtype.is_floating_point and param_dtype.itemsize > 4:
        return torch.promote_types(param_dtype, reduce_dtype)
    return reduce_dtype


def _send_for(p: nn.Parameter, m: Any, dtype: torch.dtype, world: int) -> torch.Tensor:
    """The full grad as a flat send buffer of ``world * shard_numel`` elements, in its own
    dtype if ``dtype`` holds it exactly, else in ``dtype``: the grad itself when it already
    is one, else a copy with the padding zeroed."""
    grad = p.grad.detach().reshape(-1)
    if grad.numel() != m.numel:
        raise RuntimeError(f"reduce_scatter_grads: {m.describe()} has a grad of "
                           f"{grad.numel()} elements, expected {m.numel}")
    padded = world * m.layout.shard_numel
    exact = grad.is_floating_point() and torch.promote_types(grad.dtype, dtype) == dtype
    send_dtype = grad.dtype if exact else dtype
    if grad.dtype == send_dtype and padded == m.numel and grad.device == m.device:
        return grad
    send = alloc(padded, send_dtype, m.device)
    send[:m.numel].copy_(grad)
    send[m.numel:].zero_()
    return send


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

    def discard(self) -> None:
        """Wait for the collective, add nothing: the backward whose grads it reduced failed."""
        work, self._work = self._work, None
        if work is not None:
            work.wait()


@internal
def reduce_scatter_grads(params: Iterable[nn.Parameter], group: GroupArg = None, *, accumulate: bool = True,
                         dtype: torch.dtype = torch.float32, average: bool = True,
                         async_op: bool = False) -> Optional[ReduceHandle]:
    """Reduce-scatter the full ``p.grad`` of ``params`` into their grad shards (sum or mean), freeing ``p.grad``.

    The grads are consumed: ``p.grad`` is set to None at once, and a grad tensor may itself
    be the send buffer (overwritten on gloo). With ``async_op`` the grad shards are
    updated only by the returned handle's ``wait()``.
    """
    pairs = [(p, m) for p, m in metas_sorted(params) if p.grad is not None]
    info = common_info(pairs, group, "reduce_scatter_grads")
    if not pairs:
        return ReduceHandle(None, lambda: None) if async_op else None
    dtypes = [grad_dtype(m.dtype, dtype) for _, m in pairs]
    sends = [_send_for(p, m, d, info.world_size) for (p, m), d in zip(pairs, dtypes)]
    for p, _ in pairs:
        p.grad = None
    recvs = _receive_buffers(pairs, dtypes)
    records = [m for _, m in pairs]
    if compressed_grads(records, info):  # codes with error feedback, one residual per parameter
        work = reduce_compressed(records, recvs, sends, info, [m.id for m in records], average, async_op)
    else:
        work = reduce_scatter_many(recvs, sends, info, async_op=async_op, average=average)

    def finish() -> None:
        for (_, m), part in zip(pairs, recvs):
            accumulate_into(m, part, accumulate)

    del sends  # the work keeps them until it is done
    if not async_op:
        finish()
        return None
    return ReduceHandle(work, finish)


def _receive_buffers(pairs: list, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """A fresh 1-D buffer per parameter for its reduce-scattered grad (in its ``dtypes`` entry);
    in a hybrid layout views of one buffer side by side, so the cross-replica all-reduce runs on
    it in place (core/replicas.py)."""
    if len(set(dtypes)) == 1 and all(m.replica is not None and disk.parked_version(m.shard) is None
                                     and m.device == pairs[0][1].device for _, m in pairs):
        sizes = [m.layout.shard_numel for _, m in pairs]
        return list(torch.split(alloc(sum(sizes), dtypes[0], pairs[0][1].device), sizes))
    return [disk.grad_buffer(m.shard, m.layout.shard_numel, d, partial(alloc, device=m.device), m.device)
            for (_, m), d in zip(pairs, dtypes)]


def accumulate_into(m: Any, part: torch.Tensor, accumulate: bool) -> None:
    """Add (or copy) ``part`` into the grad shard; ``part`` becomes the grad shard if there is none.
    In a hybrid layout the grad shard then awaits its cross-replica all-reduce (core/replicas.py)."""
    if m.replica is not None:
        part, accumulate = before_landing(m, part, accumulate)
    if disk.accumulate_grad(m.shard, part, accumulate):
        return
    current = m.grad_shard
    if current is None:  # kept in the wider of the reduce and shard dtypes (bf16 reduce, fp32 shard: fp32)
        m.grad_shard = part.to(m.shard.device, torch.promote_types(part.dtype, m.shard.dtype))
    elif accumulate:
        current.add_(part.to(current.device))
    else:
        current.copy_(part)


def use_shards(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Point an optimizer built on ``model.parameters()`` at the shards: every sharded parameter
    in its param groups becomes its shard (as ``shards`` gives it), group settings kept."""
    if any(optimizer.state.values()):
        raise RuntimeError("use_shards: the optimizer already has state (it has stepped or loaded a "
                           "state dict); call it right after building the optimizer")
    for group in optimizer.param_groups:
        sharded = [p for p in group["params"] if is_partitioned(p)]
        swapped = iter(shards(sharded))
        group["params"] = [next(swapped) if is_partitioned(p) else p for p in group["params"]]
    return optimizer


def shaped_shard(m: Any) -> torch.Tensor:
    """A leaf over ``m.shard`` that answers with the full shape (partition/whole/leaves.py); importing
    the whole-tensor package also installs its router in the step hooks."""
    from parts.partition.whole import shaped_shard as make
    return make(m)


def shards(module_or_params: Union[nn.Module, Iterable[nn.Parameter]]) -> list[torch.Tensor]:
    """The local shard tensors (leaves whose ``.grad`` is the grad shard and whose ``requires_grad``
    is their parameter's) for a torch optimizer; a parameter of two or more dimensions gives a leaf
    over its shard that answers with the full shape, which the optimizer's first step replaces by the
    shard or, for a shape-aware optimizer, by a whole tensor stepped by an owner rank
    (parts.partition.route)."""
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
        follow_requires_grad(m.shard, p.requires_grad)
        watch(m.shard, m)  # an optimizer's path, settled before any gather, finds the record of a plain shard
        out.append(shaped_shard(m) if len(m.shape) >= 2 else m.shard)
    return out
