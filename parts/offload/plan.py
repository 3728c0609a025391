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
point: the model's states (16 bytes per parameter with AdamW in fp32) live on disk.
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
