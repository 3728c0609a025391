"""Input checks shared by both implementations of parts.csrc (pure Python, no kernels)."""

from __future__ import annotations

from typing import Sequence

import torch


def _same_kind(t: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Raise ValueError unless `t` has the dtype and device of `ref`."""
    if t.dtype != ref.dtype:
        raise ValueError(f"{what} has dtype {t.dtype}, expected {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{what} is on {t.device}, expected {ref.device}")


def _check_tensor(t: object, what: str) -> None:
    """Raise TypeError unless `t` is a tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")


def check_flatten(tensors: Sequence[torch.Tensor]) -> None:
    """Check that `tensors` is a non-empty sequence of tensors of one dtype and device."""
    if len(tensors) == 0:
        raise ValueError("flatten: tensors is empty (dtype and device would be undefined)")
    for i, t in enumerate(tensors):
        _check_tensor(t, f"flatten: tensors[{i}]")
        _same_kind(t, tensors[0], f"flatten: tensors[{i}]")


def check_unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> None:
    """Check that `flat` is 1-D, contiguous and holds at least the numel of all of `like`."""
    _check_tensor(flat, "unflatten: flat")
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"unflatten: flat must be 1-D and contiguous, got shape {tuple(flat.shape)}")
    total = 0
    for i, t in enumerate(like):
        _check_tensor(t, f"unflatten: like[{i}]")
        total += t.numel()
    if total > flat.numel():
        raise ValueError(f"unflatten: like needs {total} elements, flat has {flat.numel()}")


def _check_contiguous(t: torch.Tensor, what: str) -> None:
    """Raise ValueError unless `t` is contiguous."""
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous")


def check_copy_in(srcs: Sequence[torch.Tensor], dst: torch.Tensor, offsets: Sequence[int]) -> None:
    """Check lengths, dtypes and that every srcs[i] fits in dst at offsets[i]."""
    _check_tensor(dst, "copy_in: dst")
    _check_contiguous(dst, "copy_in: dst")
    if len(srcs) != len(offsets):
        raise ValueError(f"copy_in: len(srcs)={len(srcs)} != len(offsets)={len(offsets)}")
    for i, (s, off) in enumerate(zip(srcs, offsets)):
        _check_tensor(s, f"copy_in: srcs[{i}]")
        _same_kind(s, dst, f"copy_in: srcs[{i}]")
        if off < 0 or off + s.numel() > dst.numel():
            raise ValueError(
                f"copy_in: srcs[{i}] ({s.numel()} elements) at offsets[{i}]={off} "
                f"does not fit in dst of {dst.numel()} elements")


def check_copy_out(src: torch.Tensor, dsts: Sequence[torch.Tensor], world_size: int,
                   offsets: Sequence[int], shard_numels: Sequence[int]) -> None:
    """Check lengths, dtypes, chunk bounds and that every dsts[i] is covered by its shards."""
    _check_tensor(src, "copy_out: src")
    _check_contiguous(src, "copy_out: src")
    if world_size < 1 or src.numel() % world_size != 0:
        raise ValueError(f"copy_out: src numel {src.numel()} is not divisible by world_size={world_size}")
    if not len(dsts) == len(offsets) == len(shard_numels):
        raise ValueError(f"copy_out: len(dsts)={len(dsts)}, len(offsets)={len(offsets)}, "
                         f"len(shard_numels)={len(shard_numels)} must match")
    chunk = src.numel() // world_size
    for i, (d, off, n) in enumerate(zip(dsts, offsets, shard_numels)):
        _check_tensor(d, f"copy_out: dsts[{i}]")
        _same_kind(d, src, f"copy_out: dsts[{i}]")
        _check_contiguous(d, f"copy_out: dsts[{i}]")
        if off < 0 or n < 0 or off + n > chunk:
            raise ValueError(f"copy_out: offsets[{i}]={off} + shard_numels[{i}]={n} "
                             f"is outside the chunk of {chunk} elements")
        if d.numel() > world_size * n:
            raise ValueError(f"copy_out: dsts[{i}] has {d.numel()} elements but the "
                             f"{world_size} shards of shard_numels[{i}]={n} hold only {world_size * n}")
