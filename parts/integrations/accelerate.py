"""``accelerate`` with a parts model: ``prepare(accelerator, model, optimizer, *dataloaders)``.

accelerate's own ``prepare`` would wrap a parts model in ``DistributedDataParallel`` (which
broadcasts and all-reduces parameters that parts keeps sharded) and, with
``mixed_precision="bf16"``, wrap its forward in autocast while the fp32 parameters stay fp32.
For a parts model both are parts' jobs, so here:

- the model is attached (``parts.partition.attach``) unless it already is, with the
  accelerator's mixed precision: ``"no"`` -> none, ``"bf16"`` ->
  ``MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` (fp32 shards are
  the masters, bf16 on the wire and in compute; parameters cast, no autocast, as accelerate
  does for FSDP2); ``"fp16"`` and ``"fp8"`` raise. A model attached by the user without bf16
  under a ``"bf16"`` accelerator raises: it would train in fp32 silently.
- the model is registered with the accelerator but neither DDP-wrapped nor autocast;
- an optimizer built over ``model.parameters()`` steps the shards instead (``use_shards``);
- ``accelerator.no_sync(model)`` (what ``accelerator.accumulate(model)`` and Trainer's
  gradient accumulation enter for every micro-batch but the last) is ``parts.partition.no_sync``:
  a hybrid layout sends its cross-replica mean once per step, with the last micro-batch's backward;
- ``accelerator.clip_grad_norm_(model.parameters(), max_norm)`` clips by the global norm over
  every rank's grad shards (``parts.partition.clip_grad_norm_``);
- ``accelerator.get_state_dict(model)`` is the full weights on rank 0 (``full_state_dict``);
- ``accelerator.save_state(dir)`` writes the model and its optimizers sharded (DCP
  directories ``parts_model_<i>/``, ``parts_optimizer_<i>_<j>/``: every rank's shard, loadable
  at any world size) beside accelerate's own files (schedulers, RNG, samplers), and
  ``accelerator.load_state(dir)`` loads them back at any world size (accelerate alone would write
  rank 0's ``state_dict`` and optimizer shard only; its ``optimizer.bin`` holds a marker instead).

All of it lives in ``PartsAcceleratorMixin``, which overrides accelerate's public methods of
those names and uses its public save/load hooks. Use ``Accelerator`` (a
drop-in ``accelerate.Accelerator``), or keep your own accelerator and call
``prepare(accelerator, ...)``, which gives it the mixin (``adopt``) the way
``torch.nn.utils.parametrize`` gives a module its parametrized class. Everything else
(dataloaders, schedulers, ``backward``, ``accumulate``, ``gather_for_metrics``) is accelerate's.

    accelerator = Accelerator(mixed_precision="bf16")
    with partitioned():
        model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader)
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Iterable, Iterator, Optional

import accelerate
import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch import nn

from parts.integrations.attached import check_attached_precision
from parts.integrations.checkpoint import (load_sharded_model, load_sharded_optimizer, save_sharded_model,
                                           save_sharded_optimizer)
from parts.partition import MixedPrecision, attach, clip_grad_norm_, full_state_dict, is_partitioned, use_shards
from parts.partition.coordinator import FetchCoordinator, attached_to
from parts.partition.interop.sharded_optim import steps_model

__all__ = ["Accelerator", "PartsAcceleratorMixin", "adopt", "prepare", "attach_for", "attach_with",
           "mixed_precision_of", "mixed_precision_policy", "is_parts_model"]

_SHARDING_TYPES = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def is_parts_model(model: Any) -> bool:
    """True for a module with parameters sharded by ``parts.partition``."""
    return isinstance(model, nn.Module) and any(is_partitioned(p) for p in model.parameters())


def mixed_precision_policy(mode: Any) -> Optional[MixedPrecision]:
    """The ``MixedPrecision`` policy that stands for accelerate's ``mixed_precision`` mode (None for "no")."""
    mode = getattr(mode, "value", mode)
    if mode in (None, "no"):
        return None
    if mode == "bf16":
        return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raise ValueError(f"parts: mixed_precision={mode!r} has no parts counterpart for a sharded model; use "
                     f"mixed_precision='bf16' (parts.partition.MixedPrecision) or 'no' (fp16 loss scaling "
                     f"is parts.optim.BF16Optimizer with a DynamicLossScaler)")


def mixed_precision_of(accelerator: accelerate.Accelerator) -> Optional[MixedPrecision]:
    """The ``MixedPrecision`` policy that stands for ``accelerator.mixed_precision``."""
    return mixed_precision_policy(accelerator.mixed_precision)


def attach_with(model: nn.Module, mode: Any) -> FetchCoordinator:
    """Attach ``model`` with the policy of the mixed-precision ``mode``, or check the coordinator it has."""
    policy = mixed_precision_policy(mode)
    coordinator = attached_to(model)
    if coordinator is None:
        return attach(model, mixed_precision=policy)
    check_attached_precision(model, coordinator, policy, "parts: mixed_precision='bf16' is asked for",
                             "attach it with mixed_precision=parts.partition.MixedPrecision() or leave "
                             "attaching to parts")
    return coordinator


def attach_for(accelerator: accelerate.Accelerator, model: nn.Module) -> FetchCoordinator:
    """Attach ``model`` with the accelerator's mixed precision, or check the coordinator it has."""
    return attach_with(model, accelerator.mixed_precision)


def _holds_sharded(optimizer: torch.optim.Optimizer) -> bool:
    return any(is_partitioned(p) for group in optimizer.param_groups for p in group["params"])


class _Checkpointing:
    """The parts models and optimizers an accelerator prepared, for its ``save_state`` / ``load_state``."""

    def __init__(self, accelerator: accelerate.Accelerator) -> None:
        self.models: list = []
        self.optimizers: list = []  # the torch optimizers (under accelerate's wrappers) over their shards
        self.saving = False
        self.busy = False  # inside accelerate's save_state / load_state
        accelerator.register_save_state_pre_hook(self.drop_weights)
        accelerator.register_load_state_pre_hook(self.drop_models)

    def owns(self, model: Any) -> bool:
        return any(model is m for m in self.models)

    def drop_weights(self, models: list, weights: list, output_dir: str) -> None:
        """accelerate's save hook: parts models are saved sharded (DCP), not as rank 0's state_dict."""
        for i in reversed(range(len(weights))):
            if self.owns(models[i]):
                del weights[i]

    def drop_models(self, models: list, input_dir: str) -> None:
        """accelerate's load hook: parts models are loaded from their DCP directory instead."""
        models[:] = [m for m in models if not self.owns(m)]


def _checkpointing(accelerator: Any) -> _Checkpointing:
    """The accelerator's record of parts models (made, and its hooks registered, on first use)."""
    record = accelerator.__dict__.get("_parts_checkpointing")
    if record is None:
        record = accelerator.__dict__["_parts_checkpointing"] = _Checkpointing(accelerator)
    return record


class PartsAcceleratorMixin:
    """accelerate's public ``prepare_model`` / ``prepare_optimizer`` / ``no_sync`` / ``clip_grad_norm_`` /
    ``get_state_dict`` / ``save_state`` / ``load_state`` for parts models."""

    def prepare_model(self, model: nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """A parts model: attached with this accelerator's mixed precision, registered, never DDP-wrapped."""
        if not is_parts_model(model):
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if self.distributed_type in _SHARDING_TYPES:
            raise ValueError(f"parts: {type(model).__name__} is already sharded by parts; launch without "
                             f"accelerate's {self.distributed_type} plugin (plain multi-process)")
        attach_for(self, model)
        record = _checkpointing(self)
        if not record.owns(model):
            record.models.append(model)
        # accelerate's evaluation mode registers the model and skips the DDP wrap; native_amp off
        # because the coordinator's MixedPrecision, not autocast, sets the compute dtype
        amp, self.native_amp = self.native_amp, False
        try:
            return super().prepare_model(model, device_placement=False, evaluation_mode=True)
        finally:
            self.native_amp = amp

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None) -> Any:
        """An optimizer over ``model.parameters()`` of a parts model steps its shards instead."""
        inner = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
        if _holds_sharded(inner):
            use_shards(inner)
        _checkpointing(self).optimizers.append(inner)  # save_state keeps those over a parts model's shards
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if type(prepared) is AcceleratedOptimizer:
            prepared.__class__ = _ShardedAcceleratedOptimizer
            prepared.parts_accelerator = self
        return prepared

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """A parts model's micro-batches inside leave the cross-replica mean to the last one
        (``parts.partition.no_sync``); any other model gets accelerate's ``no_sync``."""
        coordinator = attached_to(self.unwrap_model(model)) if is_parts_model(self.unwrap_model(model)) else None
        context = coordinator.no_sync() if coordinator is not None else super().no_sync(model)
        with context:
            yield

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2) -> torch.Tensor:
        """Clip parts parameters by the global norm over every rank's grad shards; return it."""
        params = list(parameters)
        if any(is_partitioned(p) for p in params):
            return clip_grad_norm_(params, max_norm, norm_type)
        return super().clip_grad_norm_(params, max_norm, norm_type)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict:
        """A parts model's full weights (gathered to rank 0, ``full_state_dict``): what ``save_pretrained`` takes."""
        if not is_parts_model(self.unwrap_model(model) if unwrap else model):
            return super().get_state_dict(model, unwrap=unwrap)
        if _checkpointing(self).saving:
            return {}  # save_state writes it sharded instead (drop_weights removes this entry)
        return full_state_dict(model)

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """accelerate's checkpoint, with each parts model and its optimizers saved sharded (DCP), every rank's
        shard: ``parts_model_<i>/`` and ``parts_optimizer_<i>_<j>/`` beside accelerate's files."""
        record = _checkpointing(self)
        record.saving = record.busy = True
        try:
            location = super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        finally:
            record.saving = record.busy = False
        for i, model in enumerate(record.models):
            save_sharded_model(model, os.path.join(location, f"parts_model_{i}"))
            for j, optimizer in enumerate(_optimizers_of(model, record.optimizers)):
                save_sharded_optimizer(model, optimizer, os.path.join(location, f"parts_optimizer_{i}_{j}"))
        return location

    def load_state(self, input_dir: Optional[str] = None, **kwargs: Any) -> None:
        """accelerate's ``load_state``, then each parts model and its optimizers from their DCP directories
        (written at any world size; accelerate's optimizer file holds rank 0's shard only)."""
        record = _checkpointing(self)
        if record.models and input_dir is None:
            raise ValueError("load_state: pass input_dir (the directory save_state returned) for a parts model")
        record.busy = True
        try:
            super().load_state(input_dir, **kwargs)
        finally:
            record.busy = False
        for i, model in enumerate(record.models):
            load_sharded_model(model, os.path.join(input_dir, f"parts_model_{i}"))
            for j, optimizer in enumerate(_optimizers_of(model, record.optimizers)):
                load_sharded_optimizer(model, optimizer, os.path.join(input_dir, f"parts_optimizer_{i}_{j}"))


class _ShardedAcceleratedOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper; over parts shards, inside ``save_state`` / ``load_state`` accelerate's own
    ``optimizer*.bin`` holds a marker, not one rank's shard (the state is saved sharded, loadable at any world size)."""

    def state_dict(self) -> dict:
        """The wrapped optimizer's state; inside ``save_state``, a marker in its place."""
        if self._saved_sharded():
            return {"parts": "saved sharded in the parts_optimizer_<i>_<j> DCP directories"}
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load ``state_dict``; inside ``load_state``, accelerate's file is skipped (the DCP directory is read)."""
        if not self._saved_sharded():
            super().load_state_dict(state_dict)

    def _saved_sharded(self) -> bool:
        record = _checkpointing(self.parts_accelerator)
        return record.busy and any(_optimizers_of(m, [self.optimizer]) for m in record.models)


def _optimizers_of(model: nn.Module, optimizers: list) -> list:
    """Those of ``optimizers`` that step shards of ``model`` (or full tensors standing for them)."""
    return [o for o in optimizers if steps_model(model, o)]


class Accelerator(PartsAcceleratorMixin, accelerate.Accelerator):
    """``accelerate.Accelerator`` whose ``prepare`` leaves sharding and mixed precision of parts models to parts."""


@functools.lru_cache(maxsize=None)
def _with_mixin(cls: type) -> type:
    """``cls`` with ``PartsAcceleratorMixin`` first in its MRO (one class per accelerator class)."""
    return type(f"Parts{cls.__name__}", (PartsAcceleratorMixin, cls), {"__doc__": cls.__doc__,
                                                                        "__module__": __name__})


def adopt(accelerator: accelerate.Accelerator) -> accelerate.Accelerator:
    """Give an existing accelerator the parts overrides (its class gains ``PartsAcceleratorMixin``)."""
    if not isinstance(accelerator, accelerate.Accelerator):
        raise TypeError(f"adopt: expected an accelerate.Accelerator, got {type(accelerator).__name__}")
    if not isinstance(accelerator, PartsAcceleratorMixin):
        accelerator.__class__ = _with_mixin(type(accelerator))
    return accelerator


def prepare(accelerator: accelerate.Accelerator, *objects: Any) -> Any:
    """``accelerator.prepare(*objects)`` with parts models attached, not DDP-wrapped, optimizers on shards."""
    return adopt(accelerator).prepare(*objects)
