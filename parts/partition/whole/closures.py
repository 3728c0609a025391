"""``optimizer.step(closure)`` over shards: the closure runs on the sharded model with the values the
optimizer holds, and its grads reach the optimizer's tensors before it reads them.

The step pre-hook (core/steps.py) hands the closure to ``wrap``. On every path the wrapped
closure, after the user's, finishes the grads (a hybrid layout's average across replicas) and
returns the loss averaged over the ranks, as the grads are, so that a line search or a
loss-scaled step (LBFGS, AliG) sees one process's loss on every rank. On the whole and
replicated paths it also writes the optimizer's current full values into the shards before
the user's closure (its forward reads the shards; LBFGS and SAM move the values between
calls) and gives the full tensors the new grads after it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from parts.comm import GroupInfo, all_reduce, comm_device
from parts.partition.core import steps

_WRAPPED = "_parts_closure"


def _mean(loss: Any, infos: list[GroupInfo]) -> Any:
    """``loss`` (a tensor or a number) averaged over the ranks of ``infos``."""
    if loss is None or not infos or not (torch.is_tensor(loss) or isinstance(loss, (int, float))):
        return loss
    value = loss.detach() if torch.is_tensor(loss) else torch.tensor(float(loss))
    total = value.to(comm_device(infos[0]), torch.float64, copy=True).reshape(())
    count = 1
    for info in infos:
        all_reduce(total, info)
        count *= info.world_size
    mean = (total / count).to(value.device, value.dtype)
    return mean if torch.is_tensor(loss) else float(mean)


def _closure_of(args: tuple, kwargs: dict) -> tuple[Optional[Callable], Optional[int]]:
    """The closure passed to ``step`` and its position in ``args`` (None: in ``kwargs``)."""
    if "closure" in kwargs:
        return kwargs["closure"], None
    if len(args) > 1 and callable(args[1]):
        return args[1], 1
    return None, None


def wrap(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict, stepper: Any,
         infos: list[GroupInfo]) -> Optional[tuple[tuple, dict]]:
    """``(args, kwargs)`` of ``step`` with its closure wrapped (None where it has none, or it is wrapped)."""
    closure, at = _closure_of(args, kwargs)
    if closure is None or getattr(closure, _WRAPPED, False):
        return None

    def wrapped() -> Any:
        if stepper is not None:
            with torch.no_grad():
                stepper.before_closure()
        loss = closure()
        with torch.no_grad():
            steps.grads_ready(optimizer)
            if stepper is not None:
                stepper.after_closure()
            return _mean(loss, infos)
    setattr(wrapped, _WRAPPED, True)
    if at is None:
        return args, {**kwargs, "closure": wrapped}
    return (*args[:at], wrapped, *args[at + 1:]), kwargs
