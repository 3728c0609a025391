"""Python objects between ranks without numpy: pickle into a uint8 tensor, sizes first, then bytes.

torch's own object collectives (``all_gather_object``, ``broadcast_object_list``) need numpy,
which a fresh environment does not have; nothing in ``parts`` or its recipes uses them.

An object that does not pickle on one rank must not leave the others waiting in the second
collective: that rank sends a ``Failure`` record instead, flagged in the size exchange, so
every rank raises (the failing rank its own error, the others ``RankDisagreement``).
"""

from __future__ import annotations

import pickle

import torch

from parts.comm.collectives import all_gather_list, broadcast
from parts.comm.device import comm_device, comm_tensor, to_host
from parts.comm.failure import Failure, RankDisagreement, describe
from parts.comm.group import GroupArg, GroupInfo, group_info


def _active(group: GroupArg) -> GroupInfo | None:
    """The resolved ``group`` if it has more than one rank, else None (nothing to exchange)."""
    info = group_info(group, "parts.comm object exchange")
    return info if info.world_size > 1 else None


def _to_bytes(obj: object, device: torch.device, rank: int) -> tuple[torch.Tensor, BaseException | None]:
    """``obj`` pickled into a uint8 tensor on ``device``, or a pickled ``Failure`` and the
    exception if ``obj`` does not pickle."""
    try:
        payload, error = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), None
    except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it, not wait
        payload, error = bytearray(pickle.dumps(Failure.of(exc, rank))), exc
    return torch.frombuffer(payload, dtype=torch.uint8).to(device), error


def _check(received: list[object], flags: list[int], own: BaseException | None, what: str) -> None:
    """Raise on every rank if some rank could not pickle its object (``flags[r]`` set)."""
    failures = {r: obj for r, (obj, flag) in enumerate(zip(received, flags)) if flag}
    if own is not None:
        raise own
    if failures:
        raise RankDisagreement(f"{what}: the object of another rank could not be pickled, so no rank "
                               f"went on (group ranks) {describe(failures)}")


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
    mine, error = _to_bytes(obj, device, info.rank)
    head = comm_tensor([mine.numel(), int(error is not None)], torch.int64, info)
    heads = to_host(torch.stack(all_gather_list(head, info))).tolist()  # one host copy
    sizes, flags = [h[0] for h in heads], [h[1] for h in heads]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    rows = to_host(torch.stack(all_gather_list(padded, info)))
    received = [_from_bytes(data[:size]) for data, size in zip(rows, sizes)]
    _check(received, flags, error, "all_gather_objects")
    return received


def broadcast_object(obj: object, src: int = 0, group: GroupArg = None) -> object:
    """``obj`` of group rank ``src`` on every rank (the argument is ignored elsewhere)."""
    info = _active(group)
    if info is None:
        return obj
    device = comm_device(info)
    data, error = _to_bytes(obj, device, info.rank) if info.rank == src else (None, None)
    head = comm_tensor([data.numel() if data is not None else 0, int(error is not None)], torch.int64, info)
    broadcast(head, src, info)
    size, flag = to_host(head).tolist()
    if data is None:
        data = torch.empty(size, dtype=torch.uint8, device=device)
    broadcast(data, src, info)
    result = _from_bytes(to_host(data))
    flags = [flag if r == src else 0 for r in range(info.world_size)]
    _check([result if r == src else None for r in range(info.world_size)], flags, error, "broadcast_object")
    return result
