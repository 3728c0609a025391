"""Storage accounting: the bytes of the distinct tensor storages a set of objects holds.

Views share their base's storage, so summing ``numel * element_size`` over tensors
double-counts views and misses the unused part of a storage. ``storage_bytes`` counts
each underlying storage once, whole, which is what the allocator actually holds.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

from torch.multiprocessing.reductions import StorageWeakRef

from parts._compat import TENSOR_BASE, TorchDispatchMode


_NO_TENSORS = (int, float, complex, str, bytes, torch.dtype, torch.device)


def storage_bytes(objs: Any, include_grads: bool = False) -> int:
    """Bytes of the distinct storages held by the tensors/modules in ``objs`` (nested ok)."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in iter_tensors(objs, include_grads=include_grads):
        if tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            continue
        seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


_GRAD = TENSOR_BASE.grad


def iter_tensors(objs: Any, include_grads: bool = False) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``objs``: tensors, modules (params, buffers), containers."""
    stack = [objs]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            yield obj
            grad = _GRAD.__get__(obj) if include_grads else None  # unguarded: sharded params
            if grad is not None:  # raise on a p.grad read while their grad is in a grad shard
                yield grad
        elif isinstance(obj, torch.nn.Module):
            stack.extend(obj.parameters())
            stack.extend(obj.buffers())
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif obj is not None and not isinstance(obj, _NO_TENSORS):
            raise TypeError(f"storage_bytes: cannot look for tensors in a {type(obj).__name__}")


class StorageTracker(TorchDispatchMode):
    """Records every storage that tensor ops create inside it; ``live_bytes()`` counts those still alive.

    Storage accounting independent of who holds a tensor: a storage made inside the
    ``with`` block and still referenced anywhere (Python, the autograd graph, a C++
    saved variable, a hook's closure) counts; one that was freed does not. Each storage
    counts once, whole. Storages made outside the block (parameters, inputs) never count.
    Weak references only: tracking keeps nothing alive. Costs a little per op (debug/tests).
    """

    def __init__(self) -> None:
        super().__init__()
        self._seen: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        for i, tensor in enumerate(_output_tensors(out)):
            if tensor is None:
                continue
            # views, in-place and out= results alias an input's storage: not new memory
            if i >= len(returns) or returns[i].alias_info is None:
                self._record(tensor)
        return out

    def _record(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        ref = StorageWeakRef(storage)
        entry = self._seen.get(ref.cdata)
        if entry is None or entry[0].expired():
            self._seen[ref.cdata] = (ref, storage.nbytes())

    def live_bytes(self) -> int:
        """Bytes of the recorded storages that are still alive now."""
        return sum(nbytes for ref, nbytes in self._seen.values() if not ref.expired())


def _output_tensors(out: Any) -> Iterator[Optional[torch.Tensor]]:
    """An op's results in schema order, ``None`` for the ones that are not tensors."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    for item in items:
        yield item if isinstance(item, torch.Tensor) else None
