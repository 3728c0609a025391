"""Main-thread time spent in collectives (issuing them and waiting for them), for the recipes.

Wraps the partition core's collective entry points and handle waits (outermost call only,
so a handle waiting another is counted once), minus the time the optimizer spends stepping
the parameters whose grads land inside a reduce-scatter's wait (``step_in_backward``: that
is compute and disk IO, not communication); ``remove()`` puts the originals back.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import parts.partition.core.gather as gather_mod
import parts.partition.core.grads as grads_mod
from parts.offload.backward_step import BackwardStep


class CommTimer:
    """Seconds the calling thread spent in all-gathers, reduce-scatters and their waits."""

    def __init__(self) -> None:
        self.seconds, self._depth, self._undo, self._excluded = 0.0, 0, [], 0.0
        for owner, name in ((gather_mod, "all_gather_many"), (grads_mod, "reduce_scatter_many"),
                            (gather_mod.GatherHandle, "wait"), (grads_mod.ReduceHandle, "wait")):
            self._wrap(owner, name, self._timed)
        self._wrap(BackwardStep, "land", self._excluding)

    def _wrap(self, owner: Any, name: str, wrapper: Callable[[Callable], Callable]) -> None:
        original = getattr(owner, name)
        self._undo.append((owner, name, original))
        setattr(owner, name, wrapper(original))

    def _timed(self, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            start, excluded = time.perf_counter(), self._excluded
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - start - (self._excluded - excluded)
        return timed

    def _excluding(self, fn: Callable) -> Callable:
        def excluding(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._excluded += time.perf_counter() - start
        return excluding

    def remove(self) -> None:
        """Restore the wrapped functions."""
        for owner, name, original in self._undo:
            setattr(owner, name, original)
