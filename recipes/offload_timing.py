"""Main-thread time spent in collectives (issuing them and waiting for them), for the recipes.

Wraps the partition core's collective entry points and handle waits (outermost call only,
so a handle waiting another is counted once); ``remove()`` puts the originals back.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import parts.partition.core.gather as gather_mod
import parts.partition.core.grads as grads_mod


class CommTimer:
    """Seconds the calling thread spent in all-gathers, reduce-scatters and their waits."""

    def __init__(self) -> None:
        self.seconds, self._depth, self._undo = 0.0, 0, []
        for owner, name in ((gather_mod, "all_gather_many"), (grads_mod, "reduce_scatter_many"),
                            (gather_mod.GatherHandle, "wait"), (grads_mod.ReduceHandle, "wait")):
            original = getattr(owner, name)
            self._undo.append((owner, name, original))
            setattr(owner, name, self._timed(original))

    def _timed(self, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - start
        return timed

    def remove(self) -> None:
        """Restore the wrapped functions."""
        for owner, name, original in self._undo:
            setattr(owner, name, original)
