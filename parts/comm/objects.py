"""Python objects between ranks without numpy: pickle into a uint8 tensor, sizes first, then bytes.

torch's own object collectives (``all_gather_object``, ``broadcast_object_list``) need numpy,
which a fresh environment does not have; nothing in ``parts`` or its recipes uses them.
"""

from __future__ import annotations

import pickle

import torch

from parts.comm.collectives import all_gather_list, broadcast, comm_device
from parts.comm.group import GroupArg, GroupInfo, group_info



def _active(group: GroupArg) -> GroupInfo | None:
    """The resolved ``group`` if it has more than one rank, else None (nothing to exchange)."""
    info = group_info(group, "parts.comm object exchange")
    return info if info.world_size > 1 else None


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


def all_gather_objects(obj: object, group: GroupArg = None) -> list[object]:
    """Every rank's picklable ``obj``, in group-rank order (``[obj]`` without a process group)."""
    info = _active(group)
    if info is None:
        return [obj]
    device = comm_device(info)
    mine = _to_bytes(obj, device)
    sizes = all_gather_list(torch.tensor([mine.numel()], dtype=torch.int64, device=device), info)
    longest = max(int(size.item()) for size in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    received = all_gather_list(padded, info)
    return [_from_bytes(data[: int(size.item())]) for data, size in zip(received, sizes)]


def broadcast_object(obj: object, src: int = 0, group: GroupArg = None) -> object:
    """``obj`` of group rank ``src`` on every rank (the argument is ignored elsewhere)."""
    info = _active(group)
    if info is None:
        return obj
    device = comm_device(info)
    data = _to_bytes(obj, device) if info.rank == src else None
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64, device=device)
    broadcast(size, src, info)
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    broadcast(data, src, info)
    return _from_bytes(data)
