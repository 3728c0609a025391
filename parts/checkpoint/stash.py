"""How a checkpoint keeps its inputs from forward to backward, and gets them back.

An input is *copied* (partitioned, offloaded, buffered as the policy asks) when it is a
floating-point activation: not a leaf that requires grad (parameters and user leaves are
alive anyway, a copy would only add memory) and not an integer/bool tensor (masks and ids,
small and usually shared by every layer). Every other tensor is held by reference. A held
tensor's version counter is recorded, so an in-place change before backward raises instead
of silently replaying on different values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from parts.checkpoint._collectives import gather_checksums, gather_shares
from parts.checkpoint.buffers import Slot, aligned
from parts.checkpoint.policy import CheckpointPolicy
from parts.checkpoint.replicas import checksum, differing_ranks, replica_error
from parts.base import ShardLayout, accelerator_device
from parts.comm import group_info


@dataclass
class Stashed:
    """One saved input: the tensor held and what is needed to rebuild the original."""

    path: str
    data: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    layout: Optional[ShardLayout] = None  # set when partitioned: ``data`` is this rank's share
    slot: Optional[Slot] = None
    copied: bool = False  # ``data`` is a flat copy (or share), not the original tensor
    version: int = 0


def should_copy(t: torch.Tensor, policy: CheckpointPolicy) -> bool:
    """True when ``t`` is an activation that ``policy`` partitions, offloads or buffers."""
    if t.numel() == 0 or not t.is_floating_point() or (t.is_leaf and t.requires_grad):
        return False
    if policy.partition_group is not None or policy.buffers is not None:
        return True
    return policy.cpu_offload and t.device.type != "cpu"


def stash(pairs: list[tuple[str, torch.Tensor]], policy: CheckpointPolicy) -> list[Stashed]:
    """Keep every ``(path, tensor)`` input as ``policy`` says; returns them in the same order."""
    copied = [(p, t) for p, t in pairs if should_copy(t, policy)]
    if policy.check_replicated and copied:
        check_replicated(copied, policy.partition_group)
    destinations = iter(_destinations(copied, policy))
    out = [_copy(p, t, next(destinations), policy) if should_copy(t, policy) else _reference(p, t)
           for p, t in pairs]
    for item in out:  # buffer views share one version counter: read it after every copy
        item.version = item.data._version
    return out


def _reference(path: str, t: torch.Tensor) -> Stashed:
    return Stashed(path, t.detach(), t.shape, t.dtype, t.device, t.requires_grad)


def _kept_layout(t: torch.Tensor, policy: CheckpointPolicy) -> Optional[ShardLayout]:
    if policy.partition_group is None:
        return None
    return ShardLayout(t.numel(), group_info(policy.partition_group).world_size)


def _kept_numel(t: torch.Tensor, policy: CheckpointPolicy) -> int:
    layout = _kept_layout(t, policy)
    return t.numel() if layout is None else layout.shard_numel


def _destinations(copied: list[tuple[str, torch.Tensor]],
                  policy: CheckpointPolicy) -> list[tuple[torch.Tensor, Optional[Slot]]]:
    """Empty 1-D tensors to copy each kept input into: one buffer slot, or fresh allocations."""
    if not copied:
        return []
    pin = policy.cpu_offload and accelerator_device() is not None
    device = torch.device("cpu") if policy.cpu_offload else copied[0][1].device
    sizes = [_kept_numel(t, policy) * t.element_size() for _, t in copied]
    if policy.buffers is None:
        return [(torch.empty(_kept_numel(t, policy), dtype=t.dtype, device=device, pin_memory=pin),
                 None) for _, t in copied]
    slot = policy.buffers.take(sum(aligned(n) for n in sizes), device, pin)
    out, offset = [], 0
    for (_, t), n in zip(copied, sizes):
        out.append((slot.data[offset:offset + n].view(t.dtype), slot))
        offset += aligned(n)
    return out


def _copy(path: str, t: torch.Tensor, dest: tuple[torch.Tensor, Optional[Slot]],
          policy: CheckpointPolicy) -> Stashed:
    """Copy ``t`` (or this rank's share of it, zero-padded) into ``dest``."""
    data, slot = dest
    flat = t.detach().reshape(-1)
    layout = _kept_layout(t, policy)
    if layout is not None:
        start, stop = layout.range(group_info(policy.partition_group).rank)
        flat = flat[start:stop]
    non_blocking = data.device.type == "cpu" and data.is_pinned()
    data[:flat.numel()].copy_(flat, non_blocking=non_blocking)
    data[flat.numel():].zero_()
    return Stashed(path, data, t.shape, t.dtype, t.device, t.requires_grad, layout, slot, True)


def restore(item: Stashed, policy: CheckpointPolicy) -> torch.Tensor:
    """The original input rebuilt from ``item`` (gathered, moved back), as a fresh leaf."""
    if item.slot is not None:
        policy.buffers.check(item.slot)
    if item.data._version != item.version:
        raise RuntimeError(f"checkpoint: input {item.path} was modified in place after "
                           f"checkpoint saved it (version {item.version} -> {item.data._version})")
    data = item.data.to(item.device, non_blocking=item.data.device.type == "cpu"
                        and item.data.is_pinned())
    if item.layout is not None:
        data = gather_shares(data, item.layout.padded_numel, policy.partition_group)
        data = data[:item.layout.numel]
    if item.copied:
        data = data.view(item.shape)
    return data.detach().requires_grad_(item.requires_grad)


def check_replicated(copied: list[tuple[str, torch.Tensor]], group: object) -> None:
    """Raise naming the arguments and ranks whose values differ across ``group``."""
    local = torch.stack([checksum(t) for _, t in copied]).reshape(-1)
    gathered = gather_checksums(local, group).view(-1, len(copied), 2)
    differing = differing_ranks(gathered)
    if differing:
        raise RuntimeError(replica_error([p for p, _ in copied], differing, group_info(group).global_ranks()))
