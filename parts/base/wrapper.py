"""``OptimizerWrapper``: the part of a torch-optimizer wrapper that only delegates.

``BF16Optimizer`` and ``OffloadedOptimizer`` wrap any ``torch.optim.Optimizer``: they are
``Optimizer`` instances themselves (so LR schedulers, hooks and ``isinstance`` checks work),
but their ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's, so they
cannot run ``Optimizer.__init__``. This base holds that delegation once.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from parts._compat import init_optimizer_hooks


_settle: list[Callable[[torch.optim.Optimizer, torch.optim.Optimizer], None]] = []
"""What ``parts.partition`` runs on an optimizer about to be wrapped (settling its path over the shards
before the wrapper reads its param groups); process-wide like the step hooks, it configures nothing."""


def on_wrap(fn: Callable[[torch.optim.Optimizer, torch.optim.Optimizer], None]) -> None:
    """Call ``fn(optimizer, wrapper)`` whenever an ``OptimizerWrapper`` is built around ``optimizer``."""
    if fn not in _settle:
        _settle.append(fn)


class OptimizerWrapper(torch.optim.Optimizer):
    """An ``Optimizer`` whose groups, state and defaults are those of ``self.optimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{type(self).__name__} wraps a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
        for fn in _settle:
            fn(optimizer, self)
        init_optimizer_hooks(self)
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's groups (LR schedulers change their options here)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's per-parameter state."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's defaults."""
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: the wrapper lays out every group once, at construction."""
        raise NotImplementedError(f"{type(self).__name__} cannot add param groups after construction; "
                                  "build the wrapped optimizer with all groups, then wrap it")


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer with no state its state: one step at lr 0 on zero grads.

    The weights do not move (a decoupled weight decay is scaled by lr too) and the grads and
    learning rates are put back, so a checkpoint can be taken before the first step.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(optimizer.state.get(p) for p in params):
        return
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in optimizer.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad
