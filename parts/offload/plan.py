"""Pure arithmetic of offloading: optimizer chunks and the memory bound of an offloaded run.

No torch, no IO: property-tested on its own.

Memory bound (bytes one rank holds above its baseline during an offloaded ZeRO-3 run):

    live budget        max_live_parameters * itemsize          gathered full parameters
                       + prefetch_bucket_size * itemsize       gathers in flight ahead
    shard buffers      read_ahead * itemsize / world           shards read ahead, awaiting their gather
    optimizer          3 * max(chunk_bytes, largest)           chunks being read, stepped, written
                                                               (between steps: the last chunk's writes
                                                               behind, the next first chunk's state ahead,
                                                               spare buffers for the next step's reads)
                                                               (a parameter whose own bytes, grad and
                                                               state exceed chunk_bytes is one chunk)
    store              threads * block_bytes + max_inflight    bounce buffers, transfers queued, memory
                       + reuse_bytes                           of dropped parked tensors kept for their
                                                               next loads (``DiskStore.reuse``) (a
                                                               thread's bounce buffer is 4 KiB while every
                                                               transfer it ran was aligned; it grows to a
                                                               block at the first unaligned one: a fresh
                                                               optimizer state, a caller's own tensor)
    grads              2 * reduce_bucket * 4                   full fp32 grads awaiting reduce-scatter
    alignment          (shards + optimizer + grads) / 16       a buffer the store fills starts 4096-aligned:
                                                               4 KiB longer, only if at least 64 KiB
    activations        (the model's; measured, or estimated by the caller)

``memory_bound`` adds these up; the bound holds whatever the model size, which is the
point: the model's states (16 bytes per parameter with AdamW in fp32) live on disk. It holds
for the process's RSS because the store fixes glibc's mmap threshold (``_heap``): freed
buffers of 1-32 MiB would otherwise stay in the heap, and RSS would grow with the model. The
host cache (``host_cache_bytes``: up to the whole budget) adds no term: the freed blocks it
keeps for reuse, with the large blocks in use, stay within the most large bytes the process had
in use at once.
Measured (``benchmarks/bench_offload_memory.py``, widths 512-8192): the peak stays below the
bound, and grows by a small fraction of the in-memory run's per added layer.

``split_budget`` turns one ``memory_budget`` into these knobs (``SHARES``) so that their bound
is at most 0.91 of it; ``min_budget`` is the smallest whose chunk holds a given parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def plan_chunks(costs: Sequence[int], chunk_bytes: int) -> list[tuple[int, ...]]:
    """Consecutive index runs whose ``costs`` sum to at most ``chunk_bytes`` (one item at least each)."""
    if chunk_bytes < 1:
        raise ValueError(f"plan_chunks: chunk_bytes must be >= 1, got {chunk_bytes}")
    chunks, run, total = [], [], 0
    for i, cost in enumerate(costs):
        if run and total + cost > chunk_bytes:
            chunks.append(tuple(run))
            run, total = [], 0
        run.append(i)
        total += cost
    if run:
        chunks.append(tuple(run))
    return chunks


@dataclass(frozen=True)
class OffloadBudget:
    """The knobs that bound an offloaded run's memory (sizes in elements or bytes as named)."""

    max_live_parameters: int
    prefetch_bucket_size: int
    itemsize: int
    world_size: int
    chunk_bytes: int
    store_threads: int
    block_bytes: int
    max_inflight_bytes: int
    reuse_bytes: int  # the store's ``reuse_bytes``
    reduce_bucket_size: int
    read_ahead: int = 0  # elements of full parameters whose shards are read ahead
    largest_step_bytes: int = 0  # the largest parameter's bytes + grad + state (one chunk alone)


def memory_bound(b: OffloadBudget, activations: int = 0) -> int:
    """Bytes above baseline an offloaded run may hold: the sum in the module docstring."""
    live = (b.max_live_parameters + b.prefetch_bucket_size) * b.itemsize
    shards = -(-b.read_ahead // max(b.world_size, 1)) * b.itemsize
    optimizer = 3 * max(b.chunk_bytes, b.largest_step_bytes)
    store = b.store_threads * b.block_bytes + b.max_inflight_bytes + b.reuse_bytes
    grads = 2 * b.reduce_bucket_size * 4
    alignment = (shards + optimizer + grads) // 16
    return live + shards + optimizer + store + grads + alignment + activations


# A memory budget's shares of its remainder after the IO threads' bounce buffers. Most goes to
# the optimizer chunk (three are held: ``memory_bound``), so the smallest budget is about six
# times the largest parameter's step bytes (value, grad, state); then the store's transfers in
# flight, the coordinator's live budget (gathered parameters and those prefetched), a reduce
# bucket (two full grads are held) and the reuse pool. With the read-ahead shards (twice the
# prefetch bucket over the world size) and the alignment term, ``memory_bound`` of the sized
# knobs is at most 0.91 of the budget (activations are extra).
SHARES = dict(chunk=1 / 6, max_inflight=1 / 8, live=1 / 12, reduce=1 / 32, reuse=1 / 32)
DEFAULT_FRACTION = 16  # a default budget is 1/16 of the available memory per local rank
BUDGET_GRAIN = 1 << 30  # the available memory a default budget shares, rounded down to whole GiB
MIN_DEFAULT_BUDGET, MAX_DEFAULT_BUDGET = 512 << 20, 16 << 30


@dataclass(frozen=True)
class BudgetSplit:
    """The knobs a memory budget sizes (bytes), and where the budget came from."""

    memory_budget: int
    block_bytes: int
    max_inflight_bytes: int
    reuse_bytes: int
    chunk_bytes: int
    live_bytes: int  # the coordinator's max_live_parameters + prefetch_bucket_size, in bytes
    reduce_bytes: int  # the coordinator's reduce bucket, in fp32 grad bytes
    reason: str = "given"
    given: bool = True  # the user's budget (a parameter it cannot hold is an error), or a default
    bounce_bytes: int = 0  # the IO threads' bounce buffers, taken off the top
    host_cache_bytes: int = 0  # at most this of freed compute blocks kept for reuse (``parts.csrc.host_cache``)

    def attach_knobs(self, itemsize: int) -> dict[str, int]:
        """``attach()`` sizes (elements of ``itemsize`` bytes): a third of the live budget
        prefetched (and twice that read ahead from disk), the rest gathered in use."""
        prefetch = max(1, self.live_bytes // 3 // itemsize)
        return dict(prefetch_bucket_size=prefetch, max_live_parameters=2 * prefetch,
                    reduce_bucket_size=max(1, self.reduce_bytes // 4))


def split_budget(memory_budget: int, threads: int, block_bytes: int, align: int = 4096,
                 reason: str = "given", given: bool = True) -> BudgetSplit:
    """Size the store, optimizer and coordinator windows from ``memory_budget`` bytes for one rank."""
    if memory_budget < 64 * align * threads:
        raise ValueError(f"memory_budget: {memory_budget} bytes is too small; at least "
                         f"{64 * align * threads} for {threads} IO threads")
    block = max(align, min(block_bytes, memory_budget // (16 * threads)) // align * align)
    rest = memory_budget - threads * block
    share = {name: int(rest * f) for name, f in SHARES.items()}
    return BudgetSplit(memory_budget, block, share["max_inflight"], share["reuse"], share["chunk"],
                       share["live"], share["reduce"], reason, given, threads * block,
                       memory_budget)


def min_budget(step_bytes: int, threads: int, block_bytes: int, align: int = 4096) -> int:
    """The smallest budget (bytes, to within 6) whose optimizer chunk holds a parameter's
    ``step_bytes`` (value, grad, state), for a store of ``threads`` and at most ``block_bytes`` blocks."""
    budget = 6 * step_bytes + 6
    while True:
        split = split_budget(max(budget, 64 * align * threads), threads, block_bytes, align)
        if split.chunk_bytes >= step_bytes:
            return split.memory_budget
        budget = 6 * step_bytes + split.bounce_bytes + 6


def default_budget(available: int, local_ranks: int) -> int:
    """A rank's default budget: ``1/DEFAULT_FRACTION`` of the available memory over the local ranks,
    within [MIN_DEFAULT_BUDGET, MAX_DEFAULT_BUDGET] (the rest: activations, page cache, the others)."""
    whole = available // BUDGET_GRAIN * BUDGET_GRAIN  # ranks looking a moment apart see the same
    share = whole // max(local_ranks, 1) // DEFAULT_FRACTION
    return max(MIN_DEFAULT_BUDGET, min(MAX_DEFAULT_BUDGET, share))
