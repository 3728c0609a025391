"""Handles of issued collectives: ``wait()`` blocks until the data is there."""

from __future__ import annotations

from typing import Optional, Protocol, Sequence


class Waitable(Protocol):
    """Anything with ``wait()``: a torch ``Work``, a ``WorkList``, a finished ``Work``."""

    def wait(self) -> bool:
        """Block until the collective's result is there."""


class Work:
    """A finished (or local) collective: ``wait()`` returns at once."""

    def wait(self) -> bool:
        """Nothing to wait for."""
        return True


class WorkList:
    """Several collectives issued together: ``wait()`` waits for all of them. It keeps
    ``tensors`` alive until then (an async collective must not lose its buffers)."""

    def __init__(self, works: Sequence[Waitable], tensors: tuple = ()) -> None:
        self._works, self._tensors = list(works), tensors

    def wait(self) -> bool:
        """Wait for every collective of the group, then drop the tensors."""
        for work in self._works:
            work.wait()
        self._works, self._tensors = [], ()
        return True


def finish(work: Waitable, async_op: bool) -> Optional[Waitable]:
    """A collective's result as its caller asked: the handle if ``async_op``, else None once done."""
    if async_op:
        return work
    work.wait()
    return None
