"""The backward half of the coordinator's life: a backward's start, each grad's arrival, its end.

A backward begins at the first pre-backward hook or grad hook of an attached model: the
``requires_grad`` flags are read again and checked alike on every rank (trainable.py), and the
reducer learns whether this backward defers its cross-replica mean (``no_sync``). Each grad is
handed to the reducer once its parameter's last use has passed; at the end, ranks that ran other
modules are reconciled (uneven.py) and every bucket is flushed.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from parts._compat import outside_functorch
from parts.base.weak import weak_method
from parts.partition.core.grad_guard import raw_grad
from parts.partition.coordinator.step import ModuleCall, StepState
from parts.partition.coordinator.trace import BACKWARD, phase_name


class BackwardLifecycle:
    """The backward hooks of ``FetchCoordinator``, which owns every attribute they use."""

    @outside_functorch
    def _pre_backward(self, index: int, phase: str) -> None:
        if self._root is None:
            return
        self._enter_backward(phase)
        call = ModuleCall(index, self._bwd_phase, list(self.table.sets[index]))
        self._fetch(call, BACKWARD)
        self.live.use_in_backward(call.ids)
        if torch.is_grad_enabled():  # create_graph: the grad graph being built reads these params
            self.live.hold_for_graph(call.ids)

    def _backward_step(self) -> Optional[StepState]:
        return self.steps.get(self._bwd_phase)

    def _drop_aborted_backward(self) -> None:
        """A backward that began and failed is forgotten, with all it left (abort.py)."""
        if self._bwd_phase is not None and self._root is not None and self.watch.aborted():
            phase, self._bwd_phase = self._bwd_phase, None
            self.watch.drop(phase)

    def _enter_backward(self, phase: str) -> None:
        self._drop_aborted_backward()
        if self._bwd_phase is not None:
            return
        self._bwd_phase = phase
        self._bwd_creates_graph = torch.is_grad_enabled()
        self.live.backwards += 1
        step = self.steps.get(phase) if self.steps.active(phase) else None
        deferred = self._no_sync > 0 or (step is not None and step.no_sync)
        self._follow_requires_grad(across=not deferred)
        if not self.steps.active(phase):
            self.steps.begin(phase)
        self.reducer.deferred = deferred
        self.watch.begin(self._end_backward)

    def _follow_requires_grad(self, across: bool = True) -> None:
        """Read ``requires_grad`` again (at attach and each backward's start): a grad hook on every
        parameter that requires grad now (frozen ones have none to fire), the flat reduce-scatter's
        members (reduce.py). The flags are checked alike on every rank (trainable.py; across replicas
        unless ``across`` is False, under ``no_sync``), so all reduce the same grads (under ``debug``,
        once the ranks met at the backward's start)."""
        if self._bwd_phase:
            self.check.point(None, "flags")
        self.trainable.agree(across)
        trainable = [p for p in self._unhooked if p.requires_grad]
        if trainable:
            self._unhooked = [p for p in self._unhooked if not p.requires_grad]
        for p in trainable:
            self._grad_hooks.append(p.register_post_accumulate_grad_hook(
                weak_method(self._grad_done)))  # held in C++: no uncollectable cycle
        self.reducer.follow()

    def _grad_done(self, p: nn.Parameter) -> None:
        """The last grad contribution to ``p`` in this backward arrived: a flat persistent
        parameter's grad waits in ``p.grad`` for the one reduce-scatter of them all at the end of
        backward (flat.py); any other's is handed to the reducer once ``p`` is released if idle."""
        if self._root is None:
            return
        self._enter_backward(self._bwd_phase or phase_name(True, True))
        if id(p) in self.flat_grads.index:
            return
        pid = self.table.pid(p)
        step = self.steps.get(self._bwd_phase)
        self.live.grad_complete(pid, step)
        if raw_grad(p) is not None and pid not in self.table.conditional:  # those: at the end (uneven.py)
            self.reducer.grad_ready(p, pid, step)

    def _end_backward(self) -> None:
        phase, self._bwd_phase = self._bwd_phase, None
        if self._root is None:
            return
        self.uneven.after_backward(not self.reducer.deferred)  # ranks that ran other modules (uneven.py)
        self.reducer.flush(self.steps.get(phase))
        self.uneven.log.reset()
        if not self._bwd_creates_graph:
            self.live.drop_graph_holds()
        self.live.end_backward()
        if phase in self.steps.current:
            self.steps.end(phase)
