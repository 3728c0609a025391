"""Grad buffers of parked tensors come from the store's reuse pool and go back to it."""

from __future__ import annotations

import torch

from parts.offload import DiskStore, landing, parking
from parts.offload._fileio import ALIGN


def test_grad_buffer_reuses_the_memory_given_back_and_stays_aligned(tmp_path):
    with DiskStore(str(tmp_path), reuse_bytes=8 << 20) as store:
        shard = torch.randn(300_000)
        nbytes = shard.nbytes
        parking.park(shard, store, "shard/0")  # its dropped memory is in the pool too
        held = store.reuse.held_bytes
        first = landing.grad_buffer(shard, shard.numel(), torch.float32)
        first.fill_(3.0)
        address = first.data_ptr()
        landing.give_back(first)
        assert first.untyped_storage().nbytes() == 0  # its memory is the pool's now
        assert store.reuse.held_bytes == held + nbytes + ALIGN
        second = landing.grad_buffer(shard, shard.numel(), torch.float32)
        assert second.data_ptr() == address and second.data_ptr() % ALIGN == 0
        assert store.reuse.reused == 1 and store.reuse.held_bytes == held
        assert torch.equal(second, torch.full_like(second, 3.0))  # the same pages, written before


def test_give_back_ignores_tensors_the_pool_did_not_make(tmp_path):
    with DiskStore(str(tmp_path)) as store:
        t = torch.ones(1 << 20)
        landing.give_back(t)
        assert t.untyped_storage().nbytes() == t.nbytes and store.reuse.held_bytes == 0
