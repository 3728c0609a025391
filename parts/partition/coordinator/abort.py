"""A backward that never ended: what it left is dropped before the coordinator goes on.

An exception escaping a backward half-way (a user function raising inside autograd, caught by
the user, who calls ``zero_grad()`` and trains on) ends it without its end callback: torch
runs a backward's queued callbacks only when it completes. What that backward left would
otherwise leak into the next step: full grads waiting in a reduce bucket or in ``p.grad``
(added into the next step's grad shards, out of reach of any ``zero_grad``), a reduce-scatter
in flight (its slices would land after the user's ``zero_grad``), the backward's holds on
gathered parameters, the step in progress with its half-recorded trace. This is the backward's
counterpart of ``Steps.abandon`` after a forward raised.

How it is seen: each backward queues an end token with the autograd engine, which holds the
only reference to it and drops it unrun when the backward fails. A backward that began and
whose token is gone without having run was aborted. The coordinator asks at each entry from
outside that backward: a forward's start, a backward's first hook (a retry through a retained
graph), the model's ``zero_grad()``, the end of an optimizer step. ``drop`` then forgets it all
on this rank without starting a collective (reduce-scatters in flight were started by every
rank and are only waited for), so an exception on every rank leaves the ranks agreeing, and one
on a single rank leaves the others in the collective they were in, as before.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

from parts._compat import on_backward_end
from parts.partition.core import steps as optimizer_steps
from parts.partition.core.grad_guard import raw_grad, set_raw_grad
from parts.partition.coordinator.live import LiveSet
from parts.partition.coordinator.reduce import GradReducer
from parts.partition.coordinator.steps import Steps
from parts.partition.coordinator.table import ParamTable


class _EndToken:
    """What a backward runs when it completes; the engine drops it unrun when it fails."""

    __slots__ = ("end", "__weakref__")

    def __init__(self, end: Callable[[], None]) -> None:
        self.end = end

    def __call__(self) -> None:
        self.end()


class BackwardWatch:
    """The end token of the coordinator's backward in progress, and what to drop if it failed.

    ``check`` (the coordinator's: drops an aborted backward, weakly held) also runs after every
    outermost optimizer step, until ``close``.
    """

    def __init__(self, table: ParamTable, live: LiveSet, reducer: GradReducer, steps: Steps,
                 check: Callable[[], None]) -> None:
        self.table, self.live, self.reducer, self.steps = table, live, reducer, steps
        self.check = check
        self._token: Optional[weakref.ref] = None
        optimizer_steps.listen(self.after_optimizer_step)

    def close(self) -> None:
        """Detach: no more checks after optimizer steps."""
        optimizer_steps.unlisten(self.after_optimizer_step)

    def after_optimizer_step(self) -> None:
        """An optimizer step ended: a backward that failed before it is dropped."""
        self.check()

    def begin(self, end: Callable[[], None]) -> None:
        """A backward began: ``end()`` runs when it completes (its token queued with the engine)."""
        token = _EndToken(end)
        self._token = weakref.ref(token)
        on_backward_end(token)

    def aborted(self) -> bool:
        """True if the backward that began last failed: its token is gone and never ran."""
        return self._token is not None and self._token() is None

    def drop(self, phase: str) -> None:
        """Forget the failed backward of ``phase``: its full grads pending or in ``p.grad``, its
        reduce-scatters in flight (waited, never added), its holds on parameters (released if
        idle), its step; the next step starts as if it had never begun."""
        self._token = None
        self.reducer.discard()
        for p in self.table.params.values():  # after a completed backward none holds a full grad
            if raw_grad(p) is not None:
                set_raw_grad(p, None)
        self.live.end_backward()
        self.live.drop_graph_holds()
        self.steps.abandon(phase)
