"""``PartsFabricStrategy``: Lightning Fabric's ``Fabric(strategy=...)`` for ZeRO-3 training with ``parts``.

Fabric's ``DDPStrategy`` (processes, devices, samplers, collectives, launchers) whose modules
are sharded instead of wrapped:

- ``fabric.init_module()`` shards every module built inside at once (``partitioned``), after
  ``fabric.launch()`` started the processes; ``fabric.setup`` / ``setup_module`` shards what is
  left (a module built before: rank 0's values) and attaches it (``parts.partition.attach``) with
  the strategy's knobs and the precision's policy; no DDP wrap;
- ``fabric.setup`` / ``setup_optimizers``: an optimizer over ``model.parameters()`` steps the shards;
- ``fabric.backward`` is ``loss.backward()``; ``fabric.clip_gradients`` clips by the global norm
  over every rank's grad shards, or by value; ``fabric.no_backward_sync`` is
  ``parts.partition.no_sync`` (a hybrid layout averages across replicas once per step);
- ``fabric.save(path, state)`` writes a sharded DCP folder (``parts.integrations.lightning.checkpoint``:
  every rank its own shards, the modules under their keys, the optimizers, the rest);
  ``fabric.load(path, state)`` loads it into the given modules and optimizers at any world size and
  returns what ``state`` did not ask for.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _Stateful
from torch import nn

from parts.comm import is_distributed
from parts.integrations.lightning import checkpoint as folder
from parts.integrations.lightning.clip import (clip_by_norm, clip_by_value, is_parts_model, module_stepped_by,
                                               params_stepped_by, remember)
from parts.integrations.lightning.precision import adopt_precision, mixed_precision_for
from parts.integrations.lightning.sharding import Knobs, coordinator_of, shard_and_attach
from parts.partition import (is_partitioned, load_sharded_optimizer_state_dict, load_sharded_state_dict, no_sync,
                             sharded_optimizer_state_dict, sharded_state_dict, use_shards)


class _NoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: ``parts.partition.no_sync`` of the model's coordinator."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """Backwards inside leave a hybrid layout's cross-replica mean to the first one outside."""
        if not enabled:
            return contextlib.nullcontext()
        coordinator = coordinator_of(module)
        if coordinator is None:
            raise TypeError(f"fabric.no_backward_sync: {type(module).__name__} is not set up by the parts "
                            f"strategy (fabric.setup(model) first)")
        return no_sync(coordinator)


class PartsFabricStrategy(DDPStrategy):
    """Lightning Fabric strategy: modules sharded by ``parts`` (ZeRO-3), not DDP-wrapped.

    ``Fabric(strategy="parts")`` (registered on import of ``parts.integrations.lightning``) or
    ``Fabric(strategy=PartsFabricStrategy(**knobs))``, with the knobs of ``PartsStrategy``."""

    def __init__(self, accelerator: Any = None, parallel_devices: Optional[list] = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None, precision: Any = None,
                 process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = default_pg_timeout,
                 start_method: str = "popen", **knobs: Any) -> None:
        self.parts_knobs = Knobs(type(self).__name__, knobs)
        self.parts_modules: list[nn.Module] = []  # the modules set up, for the optimizers set up after them
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        self._backward_sync_control = _NoSync()

    @property
    def precision(self) -> Any:
        """Fabric's precision plugin, with parts' conversion (``PartsPrecisionMixin``)."""
        return DDPStrategy.precision.fget(self)

    @precision.setter
    def precision(self, plugin: Any) -> None:
        DDPStrategy.precision.fset(self, adopt_precision(plugin, trainer=False))

    # ---------------------------------------------------------------- construction and set-up
    def module_init_context(self, empty_init: Optional[bool] = None) -> contextlib.AbstractContextManager:
        """Fabric's init context; modules built inside are sharded at once (after ``fabric.launch()``)."""
        stack = super().module_init_context(empty_init)
        if is_distributed():
            stack.enter_context(self.parts_knobs.partitioned(self.root_device))
        return stack

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard what ``module`` holds unsharded and attach it; the module itself is returned, unwrapped."""
        policy = mixed_precision_for(self.precision, self.parts_knobs.mixed_precision)
        if not is_parts_model(module):
            self.precision.convert_module(module)
        shard_and_attach(module, self.parts_knobs, policy, self.root_device)
        self.precision.convert_module(module)  # attached: buffers converted, shards checked
        module.to(self.root_device)  # buffers follow; the shards are on the device already (checked)
        if not any(m is module for m in self.parts_modules):
            self.parts_modules.append(module)
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """An optimizer over a set-up module's parameters steps its shards."""
        if any(is_partitioned(p) for group in optimizer.param_groups for p in group["params"]):
            use_shards(optimizer)
        for module in self.parts_modules:
            if params_stepped_by(module, optimizer):
                remember(module, optimizer)
        return optimizer

    def module_to_device(self, module: nn.Module) -> None:
        """A module moves as under DDP; one sharded but not attached yet moves in ``setup_module``."""
        if not is_parts_model(module) or coordinator_of(module) is not None:
            super().module_to_device(module)

    # ---------------------------------------------------------------- clipping
    def clip_gradients_norm(self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """Clip by the global norm over every rank's grad shards; return the norm before clipping."""
        return clip_by_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    def clip_gradients_value(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                             clip_val: Union[float, int]) -> None:
        """Clamp every grad shard to ``[-clip_val, clip_val]``."""
        clip_by_value(module, optimizer, clip_val)

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """``fabric.save``: a sharded DCP folder at ``path`` (a collective: every rank calls it)."""
        if storage_options is not None or filter is not None:
            raise NotImplementedError("parts strategy: fabric.save(storage_options=... / filter=...) is not "
                                      "supported; the checkpoint is a sharded DCP folder of the whole state")
        path = Path(self.broadcast(str(path)))
        if self.is_global_zero and path.is_file():
            path.unlink()
        modules, optimizers, rest = _split(state)
        entries = {key: _module_state(m) for key, m in modules.items()}
        for key, optimizer in optimizers.items():
            model = module_stepped_by(optimizer, modules, f"optimizer {key!r}")
            entries[key] = sharded_optimizer_state_dict(model, optimizer)
        rest = {key: (v.state_dict() if isinstance(v, _Stateful) else v) for key, v in rest.items()}
        folder.save_folder(path, entries, rest, is_global_zero=self.is_global_zero)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """``fabric.load``: the folder's entries into ``state``'s modules, optimizers and values (at any
        world size); returns the rest of the checkpoint."""
        if not isinstance(state, dict) or not state:
            raise ValueError(f"parts strategy: fabric.load(path, state) needs state={{'model': model, ...}} with "
                             f"the set-up modules (and optimizers) to load into, got {type(state).__name__}")
        path = Path(self.broadcast(str(path)))
        modules, optimizers, values = _split(state)
        entries = {key: _module_state(m) for key, m in modules.items()}
        owners = {key: module_stepped_by(o, modules, f"optimizer {key!r}") for key, o in optimizers.items()}
        for key, optimizer in optimizers.items():
            entries[key] = sharded_optimizer_state_dict(owners[key], optimizer)
        if strict and folder.is_folder(path):
            _check_present(path, {key: entries[key] for key in modules}, list(optimizers))
        rest = folder.load_folder(path, entries, strict=False, weights_only=weights_only)
        for key, module in modules.items():
            _load_module_state(module, entries[key], strict)
        for key, optimizer in optimizers.items():
            load_sharded_optimizer_state_dict(owners[key], optimizer, entries[key])
        _validate_keys_for_strict_loading(values.keys(), rest.keys(), strict=strict)
        for key in [k for k in values if k in rest]:
            if isinstance(state[key], _Stateful):
                state[key].load_state_dict(rest.pop(key))
            else:
                state[key] = rest.pop(key)
        return rest

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"parts"``."""
        if "parts" not in strategy_registry:
            strategy_registry.register("parts", cls, description="ZeRO-3 with parts: modules sharded, not DDP-wrapped")


def _split(state: dict[str, Any]) -> tuple[dict, dict, dict]:
    """``state``'s modules, optimizers and other values."""
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    return modules, optimizers, {k: v for k, v in state.items() if k not in modules and k not in optimizers}


def _module_state(module: nn.Module) -> dict[str, Any]:
    return sharded_state_dict(module) if is_parts_model(module) else dict(module.state_dict())


def _load_module_state(module: nn.Module, loaded: dict[str, Any], strict: bool) -> None:
    if is_parts_model(module):
        load_sharded_state_dict(module, loaded, strict=strict)
    else:
        module.load_state_dict(loaded, strict=strict)


def _check_present(path: Path, modules: dict[str, Any], optimizers: list[str]) -> None:
    """Raise naming the modules' keys, or the optimizers, that the folder lacks (strict loading)."""
    from parts.comm.dcp_files import read_metadata
    saved = set(read_metadata(path).state_dict_metadata)
    missing = [f"{key}.{name}" for key, entry in modules.items() for name in entry if f"{key}.{name}" not in saved]
    missing += [key for key in optimizers if not any(s.startswith(f"{key}.") for s in saved)]
    if missing:
        raise KeyError(f"parts strategy: checkpoint {path} lacks {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                       f"of the requested state (strict=False loads what both have)")


PartsFabricStrategy.register_strategies(STRATEGY_REGISTRY)
