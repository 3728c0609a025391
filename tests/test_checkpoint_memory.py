"""parts.checkpoint's memory by storage accounting: twelve checkpointed blocks keep only their
inputs between forward and backward, and backward frees them."""

from __future__ import annotations

import gc
import time

import torch
import torch.nn as nn

from parts.checkpoint import checkpoint
from parts.observe import StorageTracker
from test_checkpoint import MLP
from test_checkpoint import _one_thread  # noqa: F401 - the same autouse fixture here


def live_bytes_between_forward_and_backward(blocks, x, policy, ckpt):
    """Bytes made during forward and still reachable before backward (loss kept, output dropped).

    gc.collect() before each reading: we account for what is held, not for cyclic garbage
    the collector has not reached yet; after backward, what stays held (``_settled_live_bytes``).
    """
    torch.manual_seed(1)
    with StorageTracker() as tracker:
        h = x * 1.0
        for block in blocks:
            h = checkpoint(block, h, policy=policy) if ckpt else block(h)
        loss = h.sum()
        del h
    gc.collect()
    live = tracker.live_bytes()
    loss.backward()
    return live, _settled_live_bytes(tracker, at_most=64)


def _settled_live_bytes(tracker, at_most: int, within_s: float = 2.0) -> int:
    """Live bytes after a collection, read again for up to ``within_s`` while above ``at_most``:
    a collective waited for in backward may be released by its gloo thread a moment later, so
    only what stays held is counted (a leak stays and is returned)."""
    deadline = time.monotonic() + within_s
    while True:
        gc.collect()
        live = tracker.live_bytes()
        if live <= at_most or time.monotonic() > deadline:
            return live
        time.sleep(0.01)


def test_memory_twelve_blocks_keep_only_inputs():
    torch.manual_seed(0)
    blocks = nn.ModuleList(MLP(dim=32, hidden=128) for _ in range(12))
    x = torch.randn(4, 16, 32, requires_grad=True)
    input_bytes = x.numel() * 4
    full, _ = live_bytes_between_forward_and_backward(blocks, x, None, ckpt=False)
    ckpt, after = live_bytes_between_forward_and_backward(blocks, x, None, ckpt=True)
    assert 12 * input_bytes <= ckpt <= 12 * input_bytes + 64  # + the 4-byte loss
    assert full >= 8 * 12 * input_bytes  # fc1 out, gelu out, 2 masks, dropout out, ... per block
    assert ckpt / full < 0.125
    assert after <= 64  # backward freed every stashed input
