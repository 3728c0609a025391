"""``PartsStrategy``: Lightning's ``Trainer(strategy=...)`` for ZeRO-3 training with ``parts``.

A ``DDPStrategy`` (processes, devices, samplers, collectives and launchers as DDP has them)
whose model is sharded instead of wrapped. What differs from Lightning's DDP:

- the model is sharded at construction inside ``LightningModule.configure_model`` and
  ``trainer.init_module()`` (``parts.partition.partitioned``: under torchrun or another
  launcher that starts the processes, ``init_module`` starts the process group first); a model
  built any other way is sharded when ``fit`` / ``validate`` / ``predict`` sets it up
  (``partition_module``: rank 0's values). It is then attached (``parts.partition.attach``) with
  the strategy's knobs and the precision's policy (``parts.integrations.lightning.precision``)
  and never wrapped in DDP;
- the optimizers ``configure_optimizers`` returns over ``self.parameters()`` step the shards
  (``use_shards``; a shape-aware optimizer takes the whole-tensor path as anywhere in parts);
- ``gradient_clip_val`` clips by the global norm over every rank's grad shards, or by value;
- ``accumulate_grad_batches``: every micro-batch but the last runs under
  ``parts.partition.no_sync`` (a hybrid layout averages across replicas once per step);
- checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``) are sharded DCP folders
  (``parts.integrations.lightning.checkpoint``) holding the optimizers' and loops' state too;
  ``fit(ckpt_path=...)`` (``"last"`` included) resumes from one at any world size.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path
from typing import Any, Generator, Mapping, Optional

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from parts.comm import is_distributed
from parts.integrations.lightning import checkpoint as folder
from parts.integrations.lightning.clip import is_parts_model, remember
from parts.integrations.lightning.precision import adopt_precision, mixed_precision_for
from parts.integrations.lightning.sharding import Knobs, shard_and_attach
from parts.partition import (is_partitioned, load_sharded_optimizer_state_dict, load_sharded_state_dict, no_sync,
                             sharded_optimizer_state_dict, sharded_state_dict, use_shards)

OPTIMIZER_KEY = "parts_optimizer_{}"  # the checkpoint entry of the i-th optimizer's state


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class PartsStrategy(DDPStrategy):
    """Lightning ``Trainer`` strategy: the LightningModule sharded by ``parts`` (ZeRO-3), not DDP-wrapped.

    ``Trainer(strategy="parts")`` (registered on import of ``parts.integrations.lightning``) or
    ``Trainer(strategy=PartsStrategy(**knobs))``: the layout knobs (``remote_device``, ``pin_memory``,
    ``replicate_group``, ``mesh``, ``ranks_per_node``) go to ``partitioned``, the others
    (``persistence_threshold``, ``prefetch_bucket_size``, ``compression``, ``mixed_precision``...)
    to ``attach``; Lightning's own (``cluster_environment``, ``process_group_backend``, ``timeout``,
    ``start_method``...) are DDP's."""

    strategy_name = "parts"

    def __init__(self, accelerator: Any = None, parallel_devices: Optional[list] = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None, precision_plugin: Any = None,
                 process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = default_pg_timeout,
                 start_method: str = "popen", **knobs: Any) -> None:
        self.parts_knobs = Knobs(type(self).__name__, knobs)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)

    @property
    def precision_plugin(self) -> Any:
        """Lightning's precision plugin, with parts' conversion, clipping and step (``PartsTrainerPrecisionMixin``)."""
        return DDPStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        DDPStrategy.precision_plugin.fset(self, adopt_precision(plugin, trainer=True))

    # ---------------------------------------------------------------- construction
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Lightning's init context; modules built inside are sharded at once where the processes
        exist already (``configure_model``; ``trainer.init_module()`` under torchrun)."""
        with super().tensor_init_context(empty_init), self._sharding_at_construction():
            yield

    def _sharding_at_construction(self) -> contextlib.AbstractContextManager:
        if not is_distributed():
            if self.cluster_environment is None or not self.cluster_environment.creates_processes_externally:
                return contextlib.nullcontext()  # Lightning launches the processes at fit: shard then
            self._start_process_group()
        return self.parts_knobs.partitioned(self.root_device)

    def _start_process_group(self) -> None:
        """What ``setup_environment`` does, before ``fit``, without reseeding the RNGs."""
        self.accelerator.setup_device(self.root_device)
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)

    # ---------------------------------------------------------------- set-up
    def setup(self, trainer: Any) -> None:
        """Shard and attach the model (no DDP wrap), then set up the optimizers over its shards."""
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            raise ValueError("parts strategy: sync_batchnorm=True is not supported (parts shards parameters; "
                             "BatchNorm statistics are buffers, broadcast from rank 0 at each step's start)")
        module = self.lightning_module
        plugin = self.precision_plugin
        if not is_parts_model(module):
            plugin.convert_module(module)  # e.g. "bf16-true": shards are made from the converted weights
        policy = mixed_precision_for(plugin, self.parts_knobs.mixed_precision)
        self.parts_coordinator = shard_and_attach(module, self.parts_knobs, policy, self.root_device)
        plugin.convert_module(module)  # attached: buffers converted, shards checked
        self.model_to_device()  # buffers follow; the shards are on the device already (checked)
        plugin.parts_module = module
        self.model = module
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer: Any) -> None:
        """``configure_optimizers``' optimizers, those over the model's parameters pointed at its shards."""
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            inner = _torch_optimizer(optimizer)
            if any(is_partitioned(p) for group in inner.param_groups for p in group["params"]):
                use_shards(inner)
            remember(self.lightning_module, inner)

    def teardown(self) -> None:
        """Lightning's teardown, but the model stays where its shards are (and attached): DDP's moves it to the CPU."""
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Micro-batches before the last of an accumulation: ``parts.partition.no_sync``."""
        with no_sync(self.parts_coordinator):
            yield

    # ---------------------------------------------------------------- checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the shards, so after the model is sharded and the optimizers exist."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The optimizers are loaded with the model, in ``load_checkpoint``."""
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's shards of the weights (``sharded_state_dict`` views)."""
        return sharded_state_dict(self.lightning_module)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's shard of ``optimizer``'s state (``sharded_optimizer_state_dict``)."""
        return sharded_optimizer_state_dict(self.lightning_module, _torch_optimizer(optimizer))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write the checkpoint as a sharded DCP folder at ``filepath`` (every rank its own shards)."""
        if storage_options is not None:
            raise TypeError("parts strategy: save_checkpoint(storage_options=...) is not supported; the "
                            "checkpoint is a DCP folder written by parts, not through a CheckpointIO")
        path = Path(self.broadcast(str(filepath)))
        if self.is_global_zero and path.is_file():
            path.unlink()  # a single-file checkpoint of an earlier run at this name: the folder replaces it
        state = dict(checkpoint.pop("state_dict"))
        for i, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[OPTIMIZER_KEY.format(i)] = optimizer_state
        folder.save_folder(path, state, checkpoint, is_global_zero=self.is_global_zero)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load the sharded folder's weights (and, when fitting, optimizers) at this world size; return
        the rest (loops, callbacks, schedulers) for Lightning to restore."""
        path = Path(self.broadcast(str(checkpoint_path)))
        module = self.lightning_module
        weights = sharded_state_dict(module)
        state = dict(weights)
        optimizers = [_torch_optimizer(o) for o in self.optimizers] if self._fitting() else []
        for i, optimizer in enumerate(optimizers):
            state[OPTIMIZER_KEY.format(i)] = sharded_optimizer_state_dict(module, optimizer)
        strict = module.strict_loading
        if strict and not optimizers and folder.is_folder(path):
            missing = folder.missing_keys(path, weights)
            if missing:
                raise KeyError(f"parts strategy: checkpoint {path} lacks the model's keys {missing[:5]}"
                               f"{' ...' if len(missing) > 5 else ''} (strict_loading=False loads the keys both have)")
        rest = folder.load_folder(path, state, strict=strict and bool(optimizers), weights_only=weights_only)
        load_sharded_state_dict(module, {k: state[k] for k in weights}, strict=strict)
        for i, optimizer in enumerate(optimizers):
            load_sharded_optimizer_state_dict(module, optimizer, state[OPTIMIZER_KEY.format(i)])
        return rest

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: ``load_checkpoint`` loaded the weights into the shards."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: ``load_checkpoint`` loaded the optimizers' shards."""

    def _fitting(self) -> bool:
        trainer = self.lightning_module.trainer
        return trainer.state.fn == TrainerFn.FITTING and bool(self.optimizers)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"parts"``."""
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls,
                                       description="ZeRO-3 with parts: the model sharded, not DDP-wrapped")


PartsStrategy.register_strategies(StrategyRegistry)
