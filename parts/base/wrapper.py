"""``OptimizerWrapper``: the part of a torch-optimizer wrapper that only delegates.

``BF16Optimizer`` and ``OffloadedOptimizer`` wrap any ``torch.optim.Optimizer``: they are
``Optimizer`` instances themselves (so LR schedulers, hooks and ``isinstance`` checks work),
but their ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's, so they
cannot run ``Optimizer.__init__``. This base holds that delegation once.
"""

from __future__ import annotations

from typing import Any

import torch

from parts._compat import init_optimizer_hooks


class OptimizerWrapper(torch.optim.Optimizer):
    """An ``Optimizer`` whose groups, state and defaults are those of ``self.optimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{type(self).__name__} wraps a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
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
