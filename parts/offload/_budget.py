"""The memory budget of a ``DiskStore``: its default, and the check that it holds the largest parameter.

``plan.split_budget`` does the arithmetic; this module reads the machine (``MemAvailable``,
``LOCAL_WORLD_SIZE``) and names the parameter a user's budget cannot hold.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

from parts.base.device import host_memory_available
from parts.offload._fileio import ALIGN
from parts.offload.plan import BUDGET_GRAIN, DEFAULT_FRACTION, BudgetSplit, default_budget, min_budget, split_budget


def available_memory() -> int:
    """Bytes of memory the system can give without swapping (``MemAvailable``; all of RAM if unknown)."""
    available = host_memory_available()
    if available is not None:
        return available
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def store_budget(memory_budget: Optional[int], threads: int, block_bytes: int) -> BudgetSplit:
    """The windows ``memory_budget`` sizes; by default a share of the available memory per local rank."""
    if memory_budget is not None:
        if not isinstance(memory_budget, int) or isinstance(memory_budget, bool):
            raise TypeError(f"DiskStore: memory_budget must be an int of bytes, got {memory_budget!r}")
        return split_budget(memory_budget, threads, block_bytes, ALIGN, "given (memory_budget=)")
    available = available_memory()
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    budget = default_budget(available, ranks)
    why = (f"default: {available // BUDGET_GRAIN * BUDGET_GRAIN / 2**30:.0f} GiB (whole GiB of "
           f"{available / 2**30:.1f}) available / {ranks} local rank(s) (LOCAL_WORLD_SIZE) / "
           f"{DEFAULT_FRACTION}, within [0.5, 16] GiB")
    return split_budget(budget, threads, block_bytes, ALIGN, why, given=False)


def check_budget(store: Any, params: list[torch.Tensor], cost: Callable[[torch.Tensor], int]) -> None:
    """Refuse a parameter whose step bytes (``cost``) exceed the chunk of the user's ``memory_budget``,
    naming it and the smallest budget that holds it (a default budget takes it as its own chunk)."""
    budget = store.budget
    if not budget.given or not params:
        return
    i, big = max(enumerate(params), key=lambda ip: cost(ip[1]))
    need = cost(big)
    if need <= budget.chunk_bytes:
        return
    record = getattr(big, "__dict__", {}).get("_parts_parked")  # parking's record (parking imports the store)
    name = record.label if record is not None else f"param_groups index {i}"
    least = min_budget(need, store.threads, max(store.block_bytes, 8 << 20), ALIGN)
    raise ValueError(
        f"OffloadedOptimizer: memory_budget={budget.memory_budget} bytes of store {store.path!r} "
        f"is too small for {name!r} ({big.numel()} elements of {big.dtype}): its step holds "
        f"{need / 2**20:.1f} MiB (value, grad, state), a chunk of the budget is "
        f"{budget.chunk_bytes / 2**20:.1f} MiB; pass memory_budget >= {least}")
