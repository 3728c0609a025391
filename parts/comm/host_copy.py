"""``HostCopy``: a state dict's values copied into host memory that is kept from copy to copy.

An async save (``parts.comm.async_save``) writes from such a copy while training changes the
originals. Each tensor (and each segment of a ``ShardView``) lands in a CPU buffer named by
its place in the state dict; the next copy of a state dict of the same shapes reuses those
buffers, and a buffer no copy uses any more is dropped, so the host memory held is that of one
copy. Buffers of a tensor on an accelerator are pinned and filled with non-blocking copies,
waited for once at the end. Deferred segments (tensors in a ``DiskStore``) are read one at a
time and given back. Values that are not tensors are deep-copied.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch

from parts.base.device import synchronize_accelerator
from parts.comm.shard_view import ShardView, is_deferred

Path = tuple


class HostCopy:
    """Copies of state dicts in CPU buffers reused from one copy to the next (one copy's memory)."""

    def __init__(self) -> None:
        self._buffers: dict[Path, torch.Tensor] = {}
        self._used: dict[Path, torch.Tensor] = {}
        self._pending_device = False

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def take(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` (nested dicts, lists, tensors, ``ShardView``s, other values) whose
        tensors live in this object's host buffers; the buffers of the previous copy are reused."""
        self._used, self._pending_device = {}, False
        try:
            out = {key: self._copy(value, (key,)) for key, value in state.items()}
            if self._pending_device:
                synchronize_accelerator()
        except BaseException:
            self._buffers.update(self._used)
            raise
        finally:
            used, self._used = self._used, {}
        self._buffers = used  # what this copy did not use is dropped
        return out

    def release(self) -> None:
        """Drop every buffer."""
        self._buffers = {}

    def _copy(self, value: Any, path: Path) -> Any:
        if isinstance(value, ShardView):
            return self._copy_view(value, path)
        if isinstance(value, torch.Tensor):
            if type(value) not in (torch.Tensor, torch.nn.Parameter):
                raise TypeError(f"parts.comm.dcp.async_save: state dict entry {'.'.join(map(str, path))} is a "
                                f"{type(value).__name__}; a host copy holds plain tensors and ShardViews")
            return self._fill(path, value.detach()).view(value.shape)
        if type(value) in (dict, OrderedDict):
            return type(value)((k, self._copy(v, path + (k,))) for k, v in value.items())
        if type(value) in (list, tuple):
            return type(value)(self._copy(v, path + (i,)) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _copy_view(self, view: ShardView, path: Path) -> ShardView:
        segments = []
        for i, (start, piece) in enumerate(view.segments):
            if is_deferred(piece):
                try:
                    segments.append((start, self._fill(path + (i,), piece.materialize())))
                finally:
                    piece.settle()
            else:
                segments.append((start, self._fill(path + (i,), piece.detach())))
        return ShardView(view.shape, segments, dtype=view.dtype, device=torch.device("cpu"), name=view._label)

    def _fill(self, path: Path, source: torch.Tensor) -> torch.Tensor:
        """The host buffer at ``path`` (reused if its size and dtype fit) holding ``source``'s values, flat."""
        buffer = self._buffers.get(path)
        pin = source.device.type != "cpu"
        if buffer is None or buffer.numel() != source.numel() or buffer.dtype != source.dtype \
                or buffer.is_pinned() != pin:
            buffer = torch.empty(source.numel(), dtype=source.dtype, device="cpu", pin_memory=pin)
        buffer.view(source.shape).copy_(source, non_blocking=pin)
        self._pending_device |= pin
        self._used[path] = buffer
        return buffer
