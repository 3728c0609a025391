"""``MixedPrecision``: fp32 shards are the master, the model computes in ``param_dtype``.

The policy is plain data. ``attach(model, mixed_precision=policy)`` hands it to
``apply_mixed_precision``, which records every parameter's compute dtype on its record;
from then on the coordinator's gathers (``gather(..., compute=True)``) cast each shard to
that dtype *before* the all-gather (the wire carries bf16 bytes and the full tensor is
bf16), autograd produces bf16 full grads, and ``reduce_scatter_grads(dtype=reduce_dtype)``
sums them in fp32 (casting each chunk up as it is added, so no full-size fp32 copy of a grad
is made on gloo) and accumulates the grad shards in fp32 across micro-batches. The fp32 shards
never change dtype, so ``torch.optim.AdamW(shards(model))``
steps the masters directly: there is no separate master copy.

Modules of a ``keep_fp32`` type (e.g. ``nn.LayerNorm``) keep their parameters gathered in
full precision; their floating-point inputs are cast up and their outputs back to
``param_dtype``, so neighbouring modules see one dtype; the root module's floating inputs
are cast to ``param_dtype`` (as FSDP2 does). Gathers outside the coordinator
(``gathered``, ``full_state_dict``) stay in full precision.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from parts.partition.core.param import is_partitioned, meta

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Compute in ``param_dtype`` from fp32 shards; reduce and accumulate grads in ``reduce_dtype``."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    keep_fp32: tuple = ()  # module classes computed in full precision (their params gathered in fp32)

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in _FLOATS:
                raise ValueError(f"MixedPrecision: {name} must be a floating dtype "
                                 f"{[str(d) for d in _FLOATS]}, got {getattr(self, name)!r}")
        keep = self.keep_fp32
        keep = (keep,) if isinstance(keep, type) else tuple(keep)
        bad = [k for k in keep if not (isinstance(k, type) and issubclass(k, nn.Module))]
        if bad:
            raise TypeError(f"MixedPrecision: keep_fp32 takes nn.Module classes, got {bad!r}")
        object.__setattr__(self, "keep_fp32", keep)

    def keeps(self, module: nn.Module) -> bool:
        """True if ``module`` computes in full precision under this policy."""
        return bool(self.keep_fp32) and isinstance(module, self.keep_fp32)


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating tensor (in tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_cast_floats(x, dtype) for x in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def _check_shards(module: nn.Module, policy: MixedPrecision) -> None:
    for name, p in module.named_parameters():
        if is_partitioned(p) and meta(p).dtype != torch.float32:
            raise TypeError(f"attach(mixed_precision=...): parameter '{name}' has {meta(p).dtype} "
                            f"shards; MixedPrecision keeps fp32 shards as the master: build the model "
                            f"under partitioned() without dtype= (fp32), then attach with the policy")


def apply_mixed_precision(module: nn.Module, policy: MixedPrecision) -> Callable[[], None]:
    """Record each sharded param's compute dtype and hook ``keep_fp32`` modules; returns the undo."""
    _check_shards(module, policy)
    kept: set[int] = set()
    handles = [] if policy.keeps(module) else [module.register_forward_pre_hook(
        lambda m, args, kwargs: (_cast_floats(args, policy.param_dtype), _cast_floats(kwargs, policy.param_dtype)),
        with_kwargs=True)]
    for sub in module.modules():
        if policy.keeps(sub):
            kept.update(id(p) for p in sub.parameters(recurse=False))
            handles.append(sub.register_forward_pre_hook(
                lambda m, args, kwargs: (_cast_floats(args, torch.float32), _cast_floats(kwargs, torch.float32)),
                with_kwargs=True))
            handles.append(sub.register_forward_hook(
                lambda m, args, out: _cast_floats(out, policy.param_dtype)))
    params = [p for p in module.parameters() if is_partitioned(p)]
    for p in params:
        meta(p).compute_dtype = None if id(p) in kept else policy.param_dtype

    def undo() -> None:
        for h in handles:
            h.remove()
        for p in params:
            meta(p).compute_dtype = None
    return undo
