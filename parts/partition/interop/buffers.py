"""Buffers (BatchNorm running statistics...) kept equal on every rank, as DDP does.

Buffers are not sharded: each rank updates its own copy from its own micro-batch, so running
statistics drift apart. ``attach(model, sync_buffers=True)`` (the default, DDP's
``broadcast_buffers=True``) broadcasts rank 0's buffers at the start of every training step
(a forward with grad enabled in train mode), one broadcast per buffer dtype; a model with no
buffers pays nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from parts.comm import GroupInfo, broadcast


def broadcast_buffers(module: nn.Module, info: Optional[GroupInfo]) -> int:
    """Copy rank 0's buffers of ``module`` to every rank of ``info``; returns how many."""
    if info is None or info.world_size == 1:
        return 0
    by_kind: dict = {}
    for buf in module.buffers():
        by_kind.setdefault((buf.dtype, buf.device), []).append(buf)
    for (dtype, device), bufs in sorted(by_kind.items(), key=lambda kv: str(kv[0])):
        flat = torch.cat([b.detach().reshape(-1) for b in bufs]) if bufs else None
        broadcast(flat, 0, info)
        offset = 0
        for b in bufs:
            b.data.copy_(flat[offset:offset + b.numel()].view_as(b))
            offset += b.numel()
    return sum(len(v) for v in by_kind.values())
