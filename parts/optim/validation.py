"""Checks of BF16Optimizer's options and parameters: clear errors naming the knob or parameter.

No ``torch.distributed`` here: the checks read dtypes, devices and numbers only.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


class ParamDtypeError(TypeError, ValueError):
    """A parameter's dtype is not one BF16Optimizer keeps (a TypeError; also a ValueError, which
    dtype errors of BF16Optimizer raised before, so existing ``except ValueError`` still works)."""


def check_options(*, clip_grad: float, norm_type: float, allgather_bucket_size: Any,
                  grad_accum_dtype: Any, step_chunk: int, norm_groups: tuple,
                  replicated: Optional[Callable]) -> None:
    """Raise ValueError/TypeError naming the first bad knob of BF16Optimizer."""
    if step_chunk < 1:
        raise ValueError(f"step_chunk must be >= 1, got {step_chunk}")
    if clip_grad < 0 or norm_type < 0:
        raise ValueError(f"clip_grad and norm_type must be >= 0, got {clip_grad}, {norm_type}")
    _check_bucket(allgather_bucket_size)
    if not isinstance(grad_accum_dtype, torch.dtype) or not grad_accum_dtype.is_floating_point:
        raise ValueError(f"grad_accum_dtype must be a floating-point torch.dtype (torch.float32, "
                         f"torch.bfloat16, ...), got {grad_accum_dtype!r}")
    if replicated is not None and not callable(replicated):
        raise TypeError(f"replicated must be a callable param -> bool, got {type(replicated).__name__}")
    if replicated is not None and not norm_groups:
        raise ValueError("replicated= needs norm_groups=: it says which params hold the same grad "
                         "on every rank of those groups")


def check_param_dtype(param_dtype: Any) -> Optional[torch.dtype]:
    """``param_dtype`` if it is None or a low-precision dtype BF16Optimizer can cast params to."""
    if param_dtype is not None and param_dtype not in LOW_PRECISION:
        raise ValueError(f"param_dtype must be None (keep the params' dtype) or one of "
                         f"{[str(d) for d in LOW_PRECISION]}, got {param_dtype!r}")
    return param_dtype


def _check_bucket(size: Any) -> None:
    try:
        n = operator.index(size)
    except TypeError:
        raise TypeError(f"allgather_bucket_size must be an int, got {size!r}") from None
    if isinstance(size, bool) or n <= 0:
        raise ValueError(f"allgather_bucket_size={size!r} must be a positive number of elements")


@dataclass
class ParamChecker:
    """Checks every parameter as BF16Optimizer meets it: grad, duplicates, dtype, one dtype and device."""

    allow_fp32: bool = False
    seen: dict[int, str] = field(default_factory=dict)
    first: Optional[tuple[torch.dtype, torch.device, str]] = None

    def check(self, p: torch.Tensor, name: str, dtype: torch.dtype) -> None:
        """Raise naming ``name`` if ``p`` (stored in ``dtype``) cannot join the optimizer."""
        if id(p) in self.seen:
            raise ValueError(f"parameter {name!r} appears twice in the optimizer's groups "
                             f"(first as {self.seen[id(p)]!r})")
        self.seen[id(p)] = name
        if not p.requires_grad:
            raise ValueError(f"parameter {name!r} does not require grad; leave frozen "
                             "parameters out of the optimizer")
        self._check_dtype(name, dtype)
        if self.first is None:
            self.first = (dtype, p.device, name)
        first_dtype, first_device, first_name = self.first
        if (dtype, p.device) != (first_dtype, first_device):
            raise ValueError(f"BF16Optimizer: all params must share one dtype and device; "
                             f"{name!r} is {dtype} on {p.device}, {first_name!r} is "
                             f"{first_dtype} on {first_device}")

    def _check_dtype(self, name: str, dtype: torch.dtype) -> None:
        allowed = LOW_PRECISION + ((torch.float32,) if self.allow_fp32 else ())
        if dtype in allowed:
            return
        hint = ("cast the model first (model.to(torch.bfloat16)) or pass allow_fp32=True to keep "
                "fp32 params" if dtype == torch.float32 else "cast the model to torch.bfloat16")
        raise ParamDtypeError(f"BF16Optimizer: parameter {name!r} is {dtype}; it keeps "
                              f"torch.bfloat16 or torch.float16 params with fp32 masters "
                              f"(torch.float32 only with allow_fp32=True): {hint}")


def check_shard_group(name: str, shard_ranks: list[int], optimizer_ranks: list[int],
                      default_group: bool) -> None:
    """Raise naming ``name`` and both rank lists unless the param is sharded over the optimizer's
    group: its grad shards, the norm and the write-back live there, so another group would make
    ``step()`` wait on ranks that never come (a hang, no message)."""
    if list(shard_ranks) == list(optimizer_ranks):
        return
    which = "group=None, the default group" if default_group else "group="
    raise ValueError(f"BF16Optimizer: parameter {name!r} is sharded over global ranks "
                     f"{list(shard_ranks)}, but the optimizer's group ({which}) has global ranks "
                     f"{list(optimizer_ranks)}; pass group= the process group the model is "
                     f"sharded over (e.g. the group given to partitioned()/attach())")
