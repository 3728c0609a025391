"""``torch.func`` transforms (grad, vjp, jacrev, vmap...) through an attached model.

The coordinator's hooks run with the transforms switched off (hooks.py ``eager``, as FSDP2's
unshard and reshard do), so the full parameters they gather are plain tensors: a transform
over the model's inputs sees them as constants and works unchanged.

A transform over the sharded parameters themselves (``functional_call(model,
dict(model.named_parameters()), ...)``) cannot: the transform wraps each parameter as it is
when the call begins, a released parameter as its empty local tensor, before any hook could
gather it. The first forward that meets such a wrapper raises ``TransformError``, naming the
parameter and the ways out, instead of failing deep inside autograd.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from parts._compat import functorch_unwrapped
from parts.partition.core.param import is_partitioned, meta

TRANSFORM_HELP = (
    "torch.func transforms over an attached model's parameters need the full parameters when "
    "the transform begins. Take the transform over an unsharded copy: "
    "sd = parts.partition.full_state_dict(model, rank0_only=False), then "
    "torch.func.functional_call(model, sd, args) with grads taken w.r.t. sd; or wrap the whole "
    "transform in `with parts.partition.gathered(list(model.parameters())):`. Transforms over "
    "the model's inputs (torch.func.grad of a loss w.r.t. x) work as they are")


class TransformError(RuntimeError):
    """A ``torch.func`` transform was taken over sharded parameters that were released."""


def _released_wrapped(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The sharded parameter inside ``t`` if ``t`` is a transform's wrapper of it made while
    it was released (its shape is not the parameter's full shape), else None."""
    if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter):
        return None
    inner = functorch_unwrapped(t)
    if inner is t or not is_partitioned(inner):
        return None
    return inner if tuple(t.shape) != tuple(meta(inner).shape) else None


def check_transform_params(module: nn.Module) -> None:
    """Inside a ``torch.func`` transform: raise ``TransformError`` if a parameter ``module``
    would use is a wrapper of a released sharded parameter (``functional_call`` put it there)."""
    for name, t in module.named_parameters(remove_duplicate=False):
        inner = _released_wrapped(t)
        if inner is not None:
            alias = "" if name == meta(inner).name else f" (as '{name}' of {type(module).__name__})"
            raise TransformError(
                f"parts.partition: a torch.func transform is taken over {meta(inner).describe()}"
                f"{alias}, which is sharded over "
                f"{meta(inner).world_size} rank(s) and was released when the transform wrapped "
                f"it, so the transform sees its empty local tensor. {TRANSFORM_HELP}")
