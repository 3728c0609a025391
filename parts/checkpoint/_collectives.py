"""The collectives of parts.checkpoint: all-gather of activation shares and of checksums."""

from __future__ import annotations

import torch

from parts.comm import GroupArg, all_gather, group_info


def gather_shares(share: torch.Tensor, padded_numel: int, group: GroupArg) -> torch.Tensor:
    """All-gather every rank's equal-size 1-D ``share`` into a new tensor of ``padded_numel``.

    Sent as bytes, so every dtype (bf16, bool, ...) travels the same way on every backend.
    """
    out = torch.empty(padded_numel, dtype=share.dtype, device=share.device)
    if padded_numel:
        all_gather(out.view(torch.uint8), share.contiguous().view(torch.uint8), group_info(group))
    return out


def gather_checksums(local: torch.Tensor, group: GroupArg) -> torch.Tensor:
    """All-gather a 1-D int64 vector from every rank of ``group``: shape (group size, len)."""
    info = group_info(group)
    out = torch.empty(info.world_size * local.numel(), dtype=torch.int64, device=local.device)
    all_gather(out, local.contiguous(), info)
    return out.view(info.world_size, local.numel())
