"""Python objects between ranks without numpy: pickle into a uint8 tensor, sizes first, then bytes.

torch's own object collectives (``all_gather_object``, ``broadcast_object_list``) need numpy,
which a fresh environment does not have; nothing in ``parts`` or its recipes uses them.
"""

from __future__ import annotations

import pickle
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["all_gather_objects", "broadcast_object"]


def _active(group: Optional[Any]) -> bool:
    """True when a process group is up and ``group`` has more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _device(group: Optional[Any]) -> torch.device:
    """Where the backend of ``group`` wants its tensors: CPU for gloo, the accelerator otherwise."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    return torch.device(acc.type, torch.accelerator.current_device_index()) if acc else torch.device("cpu")


def _to_bytes(obj: object, device: torch.device) -> torch.Tensor:
    """``obj`` pickled into a uint8 tensor on ``device``."""
    payload = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    return torch.frombuffer(payload, dtype=torch.uint8).to(device)


def _from_bytes(data: torch.Tensor) -> object:
    """The object pickled in the uint8 tensor ``data``."""
    payload = bytearray(data.numel())
    if payload:
        torch.frombuffer(payload, dtype=torch.uint8).copy_(data)
    return pickle.loads(payload)


def all_gather_objects(obj: object, group: Optional[Any] = None) -> list[object]:
    """Every rank's picklable ``obj``, in group-rank order (``[obj]`` without a process group)."""
    if not _active(group):
        return [obj]
    device = _device(group)
    mine = _to_bytes(obj, device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=device), group=group)
    longest = max(int(size.item()) for size in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    received = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(received, padded, group=group)
    return [_from_bytes(data[: int(size.item())]) for data, size in zip(received, sizes)]


def broadcast_object(obj: object, src: int = 0, group: Optional[Any] = None) -> object:
    """``obj`` of group rank ``src`` on every rank (the argument is ignored elsewhere)."""
    if not _active(group):
        return obj
    device = _device(group)
    source = dist.get_global_rank(group, src) if group is not None else src
    is_source = dist.get_rank(group) == src
    data = _to_bytes(obj, device) if is_source else None
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=source, group=group)
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=source, group=group)
    return _from_bytes(data)
