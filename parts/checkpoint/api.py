"""``checkpoint``: run a function without keeping its activations; recompute them in backward.

Design: non-reentrant, built on ``torch.autograd.graph.saved_tensors_hooks``. The function
runs once in forward with grad enabled, so the autograd graph is the ordinary one, with
ordinary edges to the function's inputs and to every parameter it touches; but every
tensor the graph would save is replaced by an integer handle (the pack hook). The first
time backward unpacks a handle of a call, the call's inputs are rebuilt from what the
policy kept (a reference, a CPU copy, this rank's share gathered back), the function runs
again under the forward's RNG and autocast state, and the tensors it saves, in the same
order, answer the handles. Why this and not a custom autograd Function that re-runs
``torch.autograd.backward`` inside its backward (the reentrant design): that design can
only route gradients to the Function's explicit inputs, so it cannot serve
``torch.autograd.grad`` for parameters reached through closures or modules, and it runs a
nested backward per call. With saved-tensor hooks ``.backward()``, ``torch.autograd.grad``
(any subset of inputs), ``retain_graph`` and nested checkpoints all follow from autograd
itself. What is held between forward and backward is exactly the policy's stash of the
inputs plus an RNG snapshot; every intermediate is freed after forward.

Limits: higher-order gradients (``create_graph=True``) through a checkpoint raise; the
function must save the same tensors when recomputed (same control flow), otherwise backward
raises naming both counts. Under ``torch.no_grad()`` the function simply runs.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional

import torch
from torch.autograd.graph import saved_tensors_hooks

from parts.checkpoint._tree import Hole, map_tensors, tensors_with_paths
from parts.checkpoint.policy import CheckpointPolicy
from parts.checkpoint.rng import RNGSnapshot, replay
from parts.checkpoint.stash import Stashed, restore, stash
from parts.base import accelerator_device, synchronize_accelerator

_state = threading.local()


def checkpoint(function: Callable[..., Any], *args: Any,
               policy: Optional[CheckpointPolicy] = None, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` keeping only its inputs; recompute the rest in backward."""
    if not callable(function):
        raise TypeError(f"checkpoint: function must be callable, got {type(function).__name__}")
    if policy is not None and not isinstance(policy, CheckpointPolicy):
        raise TypeError(f"checkpoint: policy must be a CheckpointPolicy, got {type(policy).__name__}")
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if getattr(_state, "recomputing", 0):
        # inside an outer checkpoint's recompute: that graph is never differentiated, so keep
        # nothing, but still hide this call's saved tensors from the outer call's hooks
        with saved_tensors_hooks(_discard, _never_unpacked):
            return function(*args, **kwargs)
    return _Frame(function, args, kwargs, policy or CheckpointPolicy()).run(args, kwargs)


class _Frame:
    """One checkpoint call: its stashed inputs, RNG/autocast state and recomputed tensors."""

    def __init__(self, function: Callable[..., Any], args: tuple, kwargs: dict,
                 policy: CheckpointPolicy) -> None:
        self.function = function
        self.policy = policy
        pairs = list(tensors_with_paths(args, "args")) + list(tensors_with_paths(kwargs, "kwargs"))
        self.structure = map_tensors((args, kwargs), lambda _: Hole())
        self.rng = RNGSnapshot.capture(policy.rng_tracker)
        self.autocast = _autocast_state()
        with self._timed("checkpoint.stash"):
            self.stashed: list[Stashed] = stash(pairs, policy)
        self.packed = 0
        self.recomputed: dict[int, torch.Tensor] = {}

    def run(self, args: tuple, kwargs: dict) -> Any:
        """The forward pass: the function with every saved tensor replaced by a handle."""
        with self._timed("checkpoint.forward"), saved_tensors_hooks(self._pack, self._unpack):
            return self.function(*args, **kwargs)

    def _pack(self, tensor: torch.Tensor) -> int:
        self.packed += 1
        return self.packed - 1

    def _unpack(self, handle: int) -> torch.Tensor:
        if torch.is_grad_enabled():
            raise RuntimeError("checkpoint: higher-order gradients (create_graph=True) through "
                               "a checkpointed function are not supported")
        if handle not in self.recomputed:
            self._recompute()
        return self.recomputed.pop(handle)

    def _recompute(self) -> None:
        """Re-run the function on the restored inputs and keep what it saves, by handle."""
        with self._timed("checkpoint.recompute"):
            with self._timed("checkpoint.restore"):
                inputs = iter([restore(item, self.policy) for item in self.stashed])
            args, kwargs = map_tensors(self.structure, lambda _: next(inputs), leaf=Hole)
            saved: list[torch.Tensor] = []
            with _recomputing(), replay(self.rng, self.policy.rng_tracker), \
                    torch.enable_grad(), _autocast(self.autocast), \
                    saved_tensors_hooks(lambda t: saved.append(t.detach()), _never_unpacked):
                self.function(*args, **kwargs)
        if len(saved) != self.packed:
            raise RuntimeError(
                f"checkpoint: {getattr(self.function, '__qualname__', self.function)!r} saved "
                f"{self.packed} tensors in forward but {len(saved)} when recomputed; the "
                f"function must take the same path both times")
        self.recomputed = dict(enumerate(saved))

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        """Accelerator syncs (``synchronize``) and a timer (``profile``) around a block."""
        if self.policy.synchronize:
            synchronize_accelerator()
        with self.policy.timers(name) if self.policy.profile else nullcontext():
            yield
        if self.policy.synchronize:
            synchronize_accelerator()


def _discard(tensor: torch.Tensor) -> None:
    return None


def _never_unpacked(handle: Any) -> torch.Tensor:
    raise RuntimeError("checkpoint: a recomputed graph was differentiated; this is a bug in "
                       "parts.checkpoint (recompute graphs are only read for saved tensors)")


@contextmanager
def _recomputing() -> Iterator[None]:
    """Mark this thread as inside a recompute, for nested checkpoint calls."""
    _state.recomputing = getattr(_state, "recomputing", 0) + 1
    try:
        yield
    finally:
        _state.recomputing -= 1


def _autocast_state() -> list[tuple[str, torch.dtype, bool]]:
    """(device type, dtype, cache enabled) for every device type with autocast on."""
    device = accelerator_device()
    types = ["cpu"] + ([device.type] if device is not None else [])
    return [(t, torch.get_autocast_dtype(t), torch.is_autocast_cache_enabled())
            for t in types if torch.is_autocast_enabled(t)]


def _autocast(state: list[tuple[str, torch.dtype, bool]]) -> ExitStack:
    """Re-enter the autocast regions recorded by ``_autocast_state``."""
    stack = ExitStack()
    for device_type, dtype, cache in state:
        stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cache))
    return stack
