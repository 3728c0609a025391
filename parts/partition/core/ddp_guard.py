"""``DistributedDataParallel`` around any module holding sharded parameters is refused as it is made.

DDP would broadcast and all-reduce parameters that parts keeps sharded (an attached model
reduce-scatters its own grads) and read parameters released between steps. A parent of a
parts model gets wrapped too: Lightning's ``Trainer(strategy="ddp")`` wraps the
LightningModule, accelerate and others wrap whatever they are given. So the refusal does not
rely on the parts model being the one wrapped: DDP's constructor registers the module it wraps
(``self.module = module``) before its first collective, and a module registration hook common
to all modules (``torch.nn.modules.module.register_module_module_registration_hook``, installed
once, when the first parameter is sharded) raises there, on every rank alike, naming the
first sharded parameter and what to use instead. It costs one ``isinstance`` per submodule
registered anywhere in the process.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook
from torch.nn.parallel import DistributedDataParallel

from parts.partition.core.param import is_partitioned, meta

NO_DDP = "parts models need no DDP wrap"
_handle: list = []  # the hook's handle, once installed (process-wide, as the hook is)


def no_ddp_message(what: str) -> str:
    """Why a DDP wrap of a parts model is refused and what to do instead; ``what`` names the model."""
    return (f"{NO_DDP}: {what}. An attached model (parts.partition.attach) reduce-scatters its own "
            f"grads across ranks, so DistributedDataParallel would reduce them twice and read parameters "
            f"released between steps. Train the model as it is; with PyTorch Lightning use "
            f"strategy=\"parts\" (parts.integrations.lightning.PartsStrategy for the Trainer, "
            f"PartsFabricStrategy for Fabric), with accelerate parts.integrations.accelerate.prepare("
            f"accelerator, ...) (or its Accelerator), with transformers parts.integrations.transformers.Trainer")


def _first_sharded(module: nn.Module) -> Optional[Any]:
    return next((p for p in module.parameters() if is_partitioned(p)), None)


def _refuse_wrap(module: nn.Module, name: str, submodule: Optional[nn.Module]) -> None:
    """The registration hook: DDP registering a module that holds a sharded parameter raises."""
    if name != "module" or not isinstance(module, DistributedDataParallel) or submodule is None:
        return
    p = _first_sharded(submodule)
    if p is not None:
        raise RuntimeError(no_ddp_message(f"DistributedDataParallel({type(submodule).__name__}) would wrap "
                                          f"{meta(p).describe()}, sharded over {meta(p).world_size} rank(s)"))


def install() -> None:
    """Refuse DDP wraps of modules holding sharded parameters from now on (once per process)."""
    if not _handle:
        _handle.append(register_module_module_registration_hook(_refuse_wrap))
