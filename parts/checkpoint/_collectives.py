"""The collectives of parts.checkpoint: all-gather of activation shares and of checksums."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from parts._compat import all_gather_flat


def is_distributed() -> bool:
    """True when torch.distributed is available and initialised."""
    return dist.is_available() and dist.is_initialized()


def check_member(group: Optional[Any], what: str) -> None:
    """Raise ValueError naming this rank if it is not a member of ``group``."""
    if group is None or not is_distributed():
        return
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise ValueError(f"{what}: rank {dist.get_rank()} is not a member of the process group "
                         f"passed; only the ranks of a group may use it")


def group_rank(group: Optional[Any] = None) -> int:
    """This process's rank in ``group`` (default group); 0 when not distributed."""
    return dist.get_rank(group) if is_distributed() else 0


def group_size(group: Optional[Any] = None) -> int:
    """Number of ranks in ``group`` (default group); 1 when not distributed."""
    return dist.get_world_size(group) if is_distributed() else 1


def global_ranks(group: Optional[Any] = None) -> list[int]:
    """Global ranks of the members of ``group``, in group-rank order."""
    if not is_distributed():
        return [0]
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def gather_shares(share: torch.Tensor, padded_numel: int, group: Any) -> torch.Tensor:
    """All-gather every rank's equal-size 1-D ``share`` into a new tensor of ``padded_numel``.

    Sent as bytes, so every dtype (bf16, bool, ...) travels the same way on every backend.
    """
    out = torch.empty(padded_numel, dtype=share.dtype, device=share.device)
    if padded_numel:
        all_gather_flat(out.view(torch.uint8), share.contiguous().view(torch.uint8), group=group)
    return out


def gather_checksums(local: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather a 1-D int64 vector from every rank of ``group``: shape (group size, len)."""
    size = group_size(group)
    out = torch.empty(size * local.numel(), dtype=torch.int64, device=local.device)
    all_gather_flat(out, local.contiguous(), group=group)
    return out.view(size, local.numel())
