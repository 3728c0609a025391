"""Frozen parameters leave as soon as their unit's backward is over.

A trainable parameter is released when its grad is complete (its post-accumulate-grad hook).
A frozen one (``requires_grad=False``: a LoRA base weight, a frozen layer) is gathered again
for its unit's backward, which needs it for the grads of the unit's inputs, but it has no grad
and so no hook: without a release point of its own it would stay gathered until backward ends,
and a LoRA backward would hold the whole base model at once.

Its release point is the end of its unit's backward: the moment the autograd nodes that
produced the unit's inputs are about to run, every grad flowing into those inputs, the unit's
included, is complete (FSDP2 marks the same moment on the inputs). A unit whose inputs need no
grad, or are leaves, has no such moment; its frozen parameters go when backward ends.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

from parts._compat import graph_task_id
from parts.partition.coordinator.hooks import tensors_in
from parts.partition.coordinator.live import LiveSet
from parts.partition.coordinator.step import StepState
from parts.partition.coordinator.table import ParamTable


class BackwardHold:
    """Whether a unit call's pre-backward fetched (held) its parameters in the current backward."""

    __slots__ = ("graph_task",)

    def __init__(self) -> None:
        self.graph_task = None

    def wrap(self, fire: Callable[[], None]) -> Callable[[], None]:
        """``fire`` (the unit's pre-backward), noting the backward it held the parameters in."""
        def held() -> None:
            self.graph_task = graph_task_id()
            fire()
        return held

    def take(self) -> bool:
        """True once per backward in which the pre-backward held the parameters (then forgotten)."""
        mine = self.graph_task is not None and self.graph_task == graph_task_id()
        self.graph_task = None
        return mine


def after_input_grads(args: Any, done: Callable[[], None]) -> bool:
    """Call ``done()`` once per backward pass, when the grads w.r.t. every tensor in ``args`` that
    requires grad are complete (pre-hooks on the nodes that produced them). False, and nothing
    registered, if none requires grad or one is a leaf (a hook on it would outlive the graph)."""
    tensors = [t for t in tensors_in(args) if t.requires_grad]
    if not tensors or any(t.grad_fn is None for t in tensors):
        return False
    nodes = list({id(t.grad_fn): t.grad_fn for t in tensors}.values())
    state = {"graph_task": None, "left": 0}

    def hook(*_: Any) -> None:
        current = graph_task_id()
        if state["graph_task"] != current:
            state["graph_task"], state["left"] = current, len(nodes)
        state["left"] -= 1
        if state["left"] == 0:
            done()

    for node in nodes:
        node.register_prehook(hook)
    return True


class FrozenRelease:
    """Releases a unit call's frozen non-persistent parameters when its backward is over."""

    def __init__(self, table: ParamTable, live: LiveSet, step: Callable[[], Optional[StepState]]) -> None:
        self.table, self.live, self.step = table, live, step  # step(): the backward's step in progress

    def wrap(self, ids: list, args: Any, fire: Callable[[], None]) -> Callable[[], None]:
        """The unit's pre-backward ``fire``, noting its hold on the frozen ones of ``ids``, which
        are released once the grads of the call's inputs ``args`` are complete (``fire`` itself
        if there are none, or no such moment)."""
        table = self.table
        frozen = [pid for pid in ids if pid not in table.persistent and not table.params[pid].requires_grad]
        if not frozen:
            return fire
        hold = BackwardHold()
        if not after_input_grads(args, partial(self._done, frozen, hold)):
            return fire
        return hold.wrap(fire)

    def _done(self, ids: list, hold: BackwardHold) -> None:
        if hold.take():
            self.live.backward_done(ids, self.step())
