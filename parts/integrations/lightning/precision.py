"""Lightning's precision settings on a parts model, for the Trainer and the Fabric strategies.

Lightning builds a precision plugin from ``precision=``; the strategies keep it and give it
``PartsPrecisionMixin`` (its class gains the mixin, as ``parts.integrations.accelerate.adopt``
does for an accelerator), so that its own behaviour stays and only what a sharded model needs
changes:

- ``"32-true"``: fp32 shards, fp32 compute;
- ``"bf16-mixed"``: fp32 shards are the masters, gathered as bf16
  (``parts.partition.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``)
  and reduced in fp32; Lightning's autocast stays around each step, so the ops it keeps in fp32
  (softmax, layer norm, the loss) run in fp32 as with Lightning's FSDP;
- ``"bf16-true"``: everything computes in bf16 as with Lightning's ``HalfPrecision`` (weights
  gathered as bf16, inputs and new tensors bf16, no autocast), but the shards and the optimizer
  state stay fp32: parts steps full-precision shards only (a plain optimizer cannot take fp32
  grad shards for bf16 shards), so the model is built and kept in fp32 and gathered through the
  same ``MixedPrecision`` policy;
- any other precision raises when the Trainer or Fabric is built, naming the ones that work.

A model that is sharded but not yet attached is converted once the strategy attached it (then
``parts.partition``'s ``.to()`` converts buffers and refuses to change a shard's dtype), and
clipping (the Trainer's ``gradient_clip_val``) goes through ``parts.integrations.lightning.clip``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional

import torch
from torch import nn

from parts.integrations.lightning.clip import clip_by_norm, clip_by_value, is_parts_model
from parts.partition import MixedPrecision
from parts.partition.coordinator import attached_to

SUPPORTED = ("32-true", "bf16-mixed", "bf16-true")


def _name(plugin: Any) -> str:
    return str(getattr(plugin, "precision", "32-true"))


def mixed_precision_for(plugin: Any, given: Optional[MixedPrecision] = None) -> Optional[MixedPrecision]:
    """The ``MixedPrecision`` policy a model attaches with under ``plugin``: ``given`` (or the
    default bf16 one) for ``"bf16-mixed"`` and ``"bf16-true"``, None for ``"32-true"``."""
    name = _name(plugin)
    if name in ("bf16-mixed", "bf16-true"):
        return given if given is not None else MixedPrecision(param_dtype=torch.bfloat16,
                                                              reduce_dtype=torch.float32)
    if given is not None:
        raise ValueError(f"parts: mixed_precision={given!r} was given to the parts strategy but "
                         f"precision={name!r}; it applies with precision='bf16-mixed' or 'bf16-true'")
    return None


def _check(plugin: Any) -> None:
    name = _name(plugin)
    if name not in SUPPORTED:
        raise ValueError(f"parts strategy: precision={name!r} ({type(plugin).__name__}) has no parts "
                         f"counterpart; use one of {', '.join(repr(s) for s in SUPPORTED)} (fp16 loss "
                         f"scaling is parts.optim.BF16Optimizer with a DynamicLossScaler)")


class PartsPrecisionMixin:
    """A Lightning precision plugin for a parts model: conversion after attach, fp32 weights under ``"bf16-true"``."""

    def convert_module(self, module: nn.Module) -> nn.Module:
        """The plugin's conversion; a sharded model waits until it is attached (``parts.partition``'s
        ``.to()`` converts its buffers and checks its shards then); ``"bf16-true"`` keeps fp32 weights."""
        if _name(self) == "bf16-true" or (is_parts_model(module) and attached_to(module) is None):
            return module
        return super().convert_module(module)  # type: ignore[misc]

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """The plugin's; under ``"bf16-true"`` weights are made in fp32 (the shards stay fp32)."""
        if _name(self) == "bf16-true":
            return contextlib.nullcontext()
        return super().tensor_init_context()  # type: ignore[misc]

    def module_init_context(self) -> contextlib.AbstractContextManager:
        """The plugin's; under ``"bf16-true"`` weights are made in fp32 (the shards stay fp32)."""
        if _name(self) == "bf16-true":
            return contextlib.nullcontext()
        return super().module_init_context()  # type: ignore[misc]


class PartsTrainerPrecisionMixin(PartsPrecisionMixin):
    """The Trainer's precision plugin for a parts model: also clipping over grad shards, and the
    closure (forward, backward, clipping) run before the optimizer's ``step()``."""

    parts_module: Optional[nn.Module] = None  # the model clipping reads (the strategy sets it)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run the closure, then ``optimizer.step()``: the step's hooks see final grads (a hybrid
        layout's deferred cross-replica mean is then sent once per step, the whole-tensor path
        takes the last micro-batch's grads); as Lightning's AMP plugin does. LBFGS, which calls
        its closure several times, gets it inside ``step``."""
        if isinstance(optimizer, torch.optim.LBFGS):
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)  # type: ignore[misc]
        result = self._wrap_closure(model, optimizer, closure)  # type: ignore[attr-defined]
        optimizer.step(**kwargs)
        return result

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        """Clip by the global norm over every rank's grad shards of the parameters ``optimizer`` steps."""
        clip_by_norm(self._module(), optimizer, clip_val)

    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        """Clamp every grad shard of the parameters ``optimizer`` steps to ``[-clip_val, clip_val]``."""
        clip_by_value(self._module(), optimizer, clip_val)

    def _module(self) -> nn.Module:
        if self.parts_module is None:
            raise RuntimeError("parts strategy: gradient clipping before the strategy set up the model")
        return self.parts_module


@functools.lru_cache(maxsize=None)
def _with_mixin(cls: type, mixin: type) -> type:
    """``cls`` with ``mixin`` first in its MRO (one class per plugin class)."""
    return type(f"Parts{cls.__name__}", (mixin, cls), {"__doc__": cls.__doc__, "__module__": __name__})


def adopt_precision(plugin: Any, *, trainer: bool) -> Any:
    """Check that ``plugin``'s precision has a parts counterpart and give it the parts mixin
    (``PartsTrainerPrecisionMixin`` for the Trainer's plugins, ``PartsPrecisionMixin`` for Fabric's)."""
    if plugin is None:
        return None
    _check(plugin)
    mixin = PartsTrainerPrecisionMixin if trainer else PartsPrecisionMixin
    if not isinstance(plugin, mixin):
        plugin.__class__ = _with_mixin(type(plugin), mixin)
    return plugin
