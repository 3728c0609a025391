"""``.to(device)``, ``.to(dtype)``, ``.float()``, ``.bfloat16()``, ``.cpu()``... on an attached model.

They all go through ``Module._apply(fn)``, which would run ``fn`` on every parameter: on a
released one that raises deep inside torch, on a gathered one it would change the full
tensor but not the shards. ``attach`` gives every module an ``_apply`` that first asks
``fn`` what it would do to each sharded parameter (on an empty tensor of its dtype and
device): where nothing changes it is a no-op for the parameters (``Trainer`` and
``accelerate`` call ``model.to(device)`` with the device the model is already on);
anything else raises, naming the parameter and the way to get it (build the model under
``partitioned(dtype=..., device=...)``). Buffers are not sharded: ``fn`` applies to them as
in torch.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from parts.partition.core.param import is_partitioned, meta
from parts.partition.interop.overrides import install_method, installed, remove_method


def _check_params(module: nn.Module, fn: Callable, recurse: bool) -> None:
    """Raise if ``fn`` would change the dtype or device of a sharded parameter of ``module``."""
    for p in module.parameters(recurse=recurse):
        if not is_partitioned(p):
            continue
        probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))
        if probe.dtype == p.dtype and probe.device == p.device:
            continue
        raise RuntimeError(
            f"parts.partition: {meta(p).describe()} is sharded over {meta(p).world_size} rank(s) as "
            f"{p.dtype} on {p.device}; converting the model to {probe.dtype} on {probe.device} would "
            f"leave its shards (and any optimizer built on them) behind. Build the model in the dtype "
            f"and on the device you want: `with parts.partition.partitioned(dtype={probe.dtype}, "
            f"device='{probe.device}'):`, or load its weights into such a model with "
            f"parts.partition.full_state_dict / load_full_state_dict")


def _apply(module: nn.Module, fn: Callable, recurse: bool = True) -> nn.Module:
    """torch's ``Module._apply`` for a sharded model: buffers converted, sharded params checked."""
    _check_params(module, fn, recurse)
    for sub in (module.modules() if recurse else [module]):
        for key, buf in sub._buffers.items():
            if buf is not None:
                sub._buffers[key] = fn(buf)
    return module


def install_apply(modules: Iterable[nn.Module]) -> None:
    """Give every module the sharding-aware ``_apply``."""
    install_method(modules, "_apply", _apply)


def remove_apply(modules: Iterable[nn.Module]) -> None:
    """Undo ``install_apply``."""
    remove_method(modules, "_apply", _apply)


def is_attached(module: nn.Module) -> bool:
    """True if ``attach`` gave ``module`` (or a submodule) its ``_apply``: a coordinator hooks it."""
    return installed(module.modules(), "_apply", _apply)
