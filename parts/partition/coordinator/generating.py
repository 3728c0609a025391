"""``generating(model)``: inference on a sharded model without a gather per decoding step.

Under ZeRO-3 every forward gathers every layer; ``generate()`` runs one forward per token, so
it pays the whole model's all-gather per token. Inside ``generating``:

* if the gathered model fits ``memory_budget`` bytes (default: half the memory this rank may
  use, ``spare_memory``), every parameter is gathered once on entry (in its compute dtype
  under ``MixedPrecision``) and released on exit; the coordinator's hooks stand aside
  meanwhile (no fetch, no trace, no step), so a forward issues no collective at all and ranks
  may run different numbers of forwards;
* otherwise the coordinator streams the layers as in any no-grad step, prefetching along the
  recorded forward order, with its live budget lowered so that the persistent parameters and
  the gathered ones stay within ``memory_budget``; the largest parameters that leave room for
  the streamed layers stay gathered from one decoding step to the next, so each step gathers
  only the rest; every forward is a collective, so
  ``model.generate`` defaults to ``synced_gpus=True`` at world > 1 (a rank whose sequences
  ended keeps running forwards until all ranks are done).

All ranks agree on the choice (the smallest budget decides). Nothing a training step reads
changes: traces, counters and persistent parameters are as they were, so training after the
block equals training without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn

from parts.base.device import host_memory_available
from parts.comm.collectives import min_max
from parts.partition.coordinator.api import attach
from parts.partition.coordinator.coordinator import FetchCoordinator, attached_to
from parts.partition.coordinator.live import LiveSet
from parts.partition.coordinator.step import StepState
from parts.partition.coordinator.table import ParamTable
from parts.partition.core.gather import gather, release
from parts.partition.core.param import ParamStatus, is_partitioned, meta, wanted_dtype

GATHERED = "gathered"  # every parameter gathered once for the block
STREAMED = "streamed"  # layers gathered per forward within the budget


def spare_memory(device: torch.device, local_ranks: int) -> int:
    """Half the free memory of ``device`` (host memory for CPU) shared by ``local_ranks`` ranks."""
    if device.type != "cpu" and hasattr(torch.accelerator, "get_memory_info"):
        free = torch.accelerator.get_memory_info(device)[0]
        return free // 2
    return (host_memory_available() or 0) // (2 * max(local_ranks, 1))


def _coordinator_of(model: nn.Module) -> Optional[FetchCoordinator]:
    """The coordinator attached to ``model`` or to the first of its submodules that has one."""
    for sub in model.modules():
        found = attached_to(sub)
        if found is not None:
            return found
    return None


def _sharded(model: nn.Module) -> list[nn.Parameter]:
    params = [p for p in dict.fromkeys(model.parameters()) if is_partitioned(p)]
    if not params:
        raise ValueError(f"generating: {type(model).__name__} has no sharded parameters (build it under "
                         "parts.partition.partitioned() or shard it with partition_module)")
    return params


def _nbytes(p: nn.Parameter, compute: bool) -> int:
    m = meta(p)
    return m.numel * wanted_dtype(m, compute).itemsize


def _budget(memory_budget: Optional[int], params: list[nn.Parameter]) -> int:
    if memory_budget is None:
        first = meta(params[0])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or first.world_size
        return spare_memory(first.shard.device, local)
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 0:
        raise ValueError(f"generating: memory_budget must be a number of bytes >= 0, got {memory_budget!r}")
    return memory_budget


@contextlib.contextmanager
def generating(model: nn.Module, memory_budget: Optional[int] = None) -> Iterator[str]:
    """Run inference (``model.generate``, forwards) on a sharded model without a gather per step.

    Yields ``"gathered"`` (the whole model fit the budget and was gathered once) or
    ``"streamed"`` (layers are gathered per forward, within the budget). A collective on entry:
    call it on every rank."""
    coordinator = _coordinator_of(model)
    if coordinator is not None and coordinator._stack:
        raise RuntimeError("generating: called inside a forward of the attached model")
    params = _sharded(model)
    attached = coordinator is not None
    need = sum(_nbytes(p, attached) for p in params)
    budget = _budget(memory_budget, params)
    group = coordinator.group if attached else None
    fits = bool(min_max(torch.tensor([float(need <= budget)], device="cpu"), group)[0].item())
    if fits:
        with _whole(params, coordinator):
            yield GATHERED
        return
    with _streamed(model, coordinator, budget):
        yield STREAMED


@contextlib.contextmanager
def _whole(params: list[nn.Parameter], coordinator: Optional[FetchCoordinator]) -> Iterator[None]:
    """Every parameter gathered for the block, the hooks standing aside; released on exit."""
    before = {id(p) for p in params if meta(p).status is ParamStatus.AVAILABLE}
    pool = coordinator.live.pool if coordinator is not None else None
    group = coordinator.group if coordinator is not None else None
    gather(params, group, pool=pool, compute=coordinator is not None)
    aside = _hooks_aside(coordinator) if coordinator is not None else contextlib.nullcontext()
    try:
        with aside:
            yield
    finally:
        release([p for p in params if id(p) not in before], free_storage=True, pool=pool)


@contextlib.contextmanager
def _hooks_aside(coordinator: FetchCoordinator) -> Iterator[None]:
    """Every hook of ``coordinator`` returns at once (it sees no root) while the block runs."""
    state = getattr(coordinator, "_state", None)  # the attached state, where the root lives
    holder, name = (state, "root") if state is not None and hasattr(state, "root") else (coordinator, "_root")
    root = getattr(holder, name)
    setattr(holder, name, None)
    try:
        yield
    finally:
        setattr(holder, name, root)


def _largest_unit(coordinator: FetchCoordinator) -> int:
    """Elements of the largest fetch unit that is not persistent: the least a forward holds."""
    table = coordinator.table
    sizes = [sum(table.sizes[pid] for pid in ids if pid not in table.persistent) for ids in table.sets]
    return max(sizes, default=0)


def _live_budget(coordinator: FetchCoordinator, budget: int) -> int:
    """``budget`` bytes less the persistent parameters, in elements of the widest compute dtype."""
    table = coordinator.table
    params = [table.params[pid] for pid in table.params]
    persistent = sum(_nbytes(table.params[pid], True) for pid in table.persistent)
    itemsize = max(wanted_dtype(meta(p), True).itemsize for p in params)
    elements = (budget - persistent) // itemsize
    least = _largest_unit(coordinator)
    if elements < least:
        raise ValueError(f"generating: memory_budget={budget} bytes cannot hold the persistent parameters "
                         f"({persistent} bytes) and the largest fetch unit ({least * itemsize} bytes); "
                         "raise the budget, or attach with a smaller fetch_unit_size / persistence_threshold")
    return elements


@contextlib.contextmanager
def _streamed(model: nn.Module, coordinator: Optional[FetchCoordinator], budget: int) -> Iterator[None]:
    """The coordinator's no-grad steps within ``budget``; ``generate`` in lock step across ranks."""
    temporary = coordinator is None
    if temporary:
        coordinator = attach(model)
    knobs = coordinator.knobs
    try:
        live = _live_budget(coordinator, budget)
    except ValueError:
        if temporary:
            coordinator.detach()
        raise
    tight = dataclasses.replace(knobs, max_live_parameters=min(knobs.max_live_parameters, live))
    coordinator.live.knobs = coordinator.prefetcher.knobs = tight
    world = next(iter(coordinator.table.records.values())).world_size
    synced = _SyncedGenerate(model, enabled=world > 1)
    kept = _KeepBetweenSteps(coordinator.live, coordinator.table)
    try:
        yield
    finally:
        kept.close()
        synced.close()
        coordinator.live.knobs = coordinator.prefetcher.knobs = knobs
        if temporary:
            coordinator.detach()


class _KeepBetweenSteps:
    """Keep some gathered parameters from one no-grad step to the next instead of releasing them
    after use: the next decoding step finds them gathered (nothing steps the shards meanwhile)
    and gathers only the rest. Kept are the largest that leave room, within the live budget,
    for the largest fetch unit still streamed (prefetch takes what room is left), so streaming
    never has to evict them. A kept parameter gets a hold of its own when the first forward
    that used it returns; every rank keeps the same (arithmetic on sizes and units). ``close``
    drops the holds and releases them (no collective)."""

    def __init__(self, live: LiveSet, table: ParamTable) -> None:
        self.live, self.plain = live, live.done_with
        units = [ids for index, ids in enumerate(table.sets) if ids and table.is_unit_root(index)]
        self.keep = keep_plan(table.sizes, units, table.persistent, live.knobs.max_live_parameters)
        self.held: list[int] = []
        live.done_with = self.done_with

    def done_with(self, ids: Sequence[int], step: Optional[StepState]) -> None:
        """A forward returned: hold the kept ones among ``ids`` first, then the coordinator's own."""
        fresh = [pid for pid in dict.fromkeys(ids) if pid in self.keep and pid not in self.held]
        self.live.use(fresh)
        self.held.extend(fresh)
        self.plain(ids, step)

    def close(self) -> None:
        """The coordinator's own ``done_with`` again; the kept parameters released."""
        del self.live.done_with
        for pid in self.held:
            self.live.uses[pid] -= 1
        self.live.release(self.live.idle())


def keep_plan(sizes: dict, units: list, persistent: frozenset, budget: int) -> frozenset:
    """Params (largest first) to keep gathered between steps while ``kept + the largest unit's
    streamed elements`` fits ``budget`` elements."""
    kept: set = set()
    total = 0

    def streamed(extra: int) -> int:
        return max((sum(sizes[p] for p in ids if p not in kept and p not in persistent and p != extra)
                    for ids in units), default=0)

    for pid in sorted((p for p in sizes if p not in persistent), key=lambda p: (-sizes[p], p)):
        if total + sizes[pid] + streamed(pid) <= budget:
            kept.add(pid)
            total += sizes[pid]
    return frozenset(kept)


class _SyncedGenerate:
    """``model.generate`` with ``synced_gpus=True`` as its default while the block runs (``enabled``)."""

    def __init__(self, model: nn.Module, enabled: bool) -> None:
        self.model = model
        plain = getattr(model, "generate", None)
        self.installed = enabled and "generate" not in vars(model) and callable(plain)
        if self.installed:
            @functools.wraps(plain)
            def generate(*args: Any, **kwargs: Any) -> Any:
                kwargs.setdefault("synced_gpus", True)
                return plain(*args, **kwargs)

            model.generate = generate

    def close(self) -> None:
        """Give the model its own ``generate`` back."""
        if self.installed:
            del self.model.generate
