"""The world-independent batch split of reproducible mode: a global batch cut into ``units``.

A run attached with ``attach(model, reproducible=True)`` gives the same weights at every world
size that divides ``units`` when each step's global batch is cut into the same ``units`` pieces
and each piece's loss is divided by ``units``: every rank computes its ``units / world``
consecutive pieces one by one, as micro-batches (``backward_units``), and the fixed-point sums
(core/exact_grads.py) add the same per-unit grads whichever rank computed them. One process with
``units`` micro-batches computes what any world size computes. A model with dropout draws
the same masks only if each unit seeds its own randomness: ``seed`` does it per (step, unit).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from parts.comm import GroupArg, all_gather_list, comm_device, group_info, is_distributed
from parts.partition.coordinator.api import no_sync
from parts.partition.coordinator.coordinator import attached_to

Batch = Union[torch.Tensor, Sequence[torch.Tensor]]


def unit_range(units: int, rank: int, world: int) -> range:
    """The global indices of the units that ``rank`` of ``world`` computes: ``units / world``
    consecutive ones; ValueError unless ``world`` divides ``units``."""
    if not isinstance(units, int) or isinstance(units, bool) or units < 1:
        raise ValueError(f"unit_range: units must be a positive int, got {units!r}")
    if units % world:
        raise ValueError(f"unit_range: units={units} is not divisible by the world size {world}; "
                         f"reproducible mode needs the same units on every world size: pick units "
                         f"as a multiple of every world size the run may use")
    per = units // world
    return range(rank * per, (rank + 1) * per)


def unit_rows(length: int, units: int, index: int) -> slice:
    """The rows of unit ``index`` in a global batch of ``length`` rows; ValueError unless ``units`` divides it."""
    if length % units:
        raise ValueError(f"unit_rows: a global batch of {length} rows does not split into units={units} "
                         f"equal units")
    size = length // units
    return slice(index * size, (index + 1) * size)


def _where(group: GroupArg) -> tuple[int, int]:
    """``(rank, world)`` of ``group`` (the default group), ``(0, 1)`` when not distributed."""
    if not is_distributed():
        return 0, 1
    info = group_info(group, "backward_units(group=...)")
    return info.rank, info.world_size


def _rows(batch: Batch, rows: slice) -> Batch:
    if isinstance(batch, torch.Tensor):
        return batch[rows]
    return type(batch)(t[rows] for t in batch)


def backward_units(model: nn.Module, batch: Batch, units: int,
                   loss_fn: Callable[[nn.Module, Batch], torch.Tensor], *, group: GroupArg = None,
                   seed: Optional[int] = None) -> torch.Tensor:
    """Forward and backward of this rank's units of the global ``batch`` (a tensor or a tuple of
    tensors with the global batch on dim 0), one micro-batch each, each loss divided by ``units``;
    a hybrid layout's cross-replica sum waits for the last (``no_sync``). ``seed``: the torch RNG
    is seeded with ``seed * units + unit`` before each unit (dropout draws the same masks at any
    world size). Returns the mean loss over all ``units`` (float64, the same bits at any world
    size: a collective over ``group``, the data-parallel world, default: every rank)."""
    rank, world = _where(group)
    mine = unit_range(units, rank, world)
    length = (batch if isinstance(batch, torch.Tensor) else batch[0]).shape[0]
    losses = []
    coordinator = attached_to(model)
    for index in mine:
        if seed is not None:
            torch.manual_seed(seed * units + index)
        last = index == mine[-1]
        with (no_sync(model) if coordinator is not None and not last else contextlib.nullcontext()):
            loss = loss_fn(model, _rows(batch, unit_rows(length, units, index)))
            (loss / units).backward()
        losses.append(loss.detach().to(torch.float64).reshape(()))
    return mean_loss(torch.stack(losses), units, group)


def mean_loss(local: torch.Tensor, units: int, group: GroupArg = None) -> torch.Tensor:
    """The mean over all ``units`` of the per-unit losses, each rank holding its ``local`` ones in
    unit order: gathered in unit order and added in that order (float64), so the same bits at any
    world size."""
    local = local.to(torch.float64).reshape(-1)
    if is_distributed():
        info = group_info(group, "mean_loss(group=...)")
        local = torch.cat(all_gather_list(local.to(comm_device(info)), info))
    if local.numel() != units:
        raise ValueError(f"mean_loss: got {local.numel()} unit losses across ranks, expected units={units}")
    total = torch.zeros((), dtype=torch.float64)
    for value in local.cpu():  # in unit order
        total = total + value
    return total / units
