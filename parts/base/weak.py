"""Hooks that do not keep their owner alive.

A hook registered on a tensor (``register_post_accumulate_grad_hook``) is held by the tensor
on the C++ side, where Python's garbage collector cannot see it. A hook that is a bound method
of an object which itself references the tensor (a coordinator, an optimizer) closes a cycle
the collector never frees: the object, its model and its process group (with gloo's threads)
then live until interpreter teardown, past ``destroy_process_group`` (see ``parts.comm.WeakGroup``).
``weak_method`` breaks the cycle: the hook holds its object weakly and does nothing once the
object is gone.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """A function calling bound ``method`` while its object lives (a no-op returning None after)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        return None if target is None else target(*args, **kwargs)

    call.__qualname__ = f"weak_method({getattr(method, '__qualname__', 'method')})"
    return call
