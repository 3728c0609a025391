"""Find and replace the tensors inside nested call arguments (tuples, lists, dicts)."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch


def tensors_with_paths(obj: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``obj`` with a readable path such as ``args[1]`` or ``kwargs['mask']``."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from tensors_with_paths(item, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from tensors_with_paths(item, f"{path}[{key!r}]")


def map_tensors(obj: Any, fn: Callable[[Any], Any], leaf: type = torch.Tensor) -> Any:
    """A copy of ``obj`` with every ``leaf`` (tensor) replaced by ``fn(leaf)``, in traversal order."""
    if isinstance(obj, leaf):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(item, fn, leaf) for item in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(item, fn, leaf) for item in obj)
    if isinstance(obj, dict):
        return type(obj)((key, map_tensors(item, fn, leaf)) for key, item in obj.items())
    return obj


class Hole:
    """Placeholder left where a tensor argument was, so the structure holds no tensor."""

    __slots__ = ()
