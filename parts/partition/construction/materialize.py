"""Give a model built on the meta device real shards, one module at a time.

``partitioned(device="meta")`` records every parameter's shape, layout and id without data.
``materialize(model, init_fn, device=...)`` then walks the modules that own parameters: for
each it allocates that module's full parameters (and meta buffers) on ``device``, runs
``init_fn(module)`` on them, and shards them with rank 0's values as construction does. So no
rank ever holds more than one module's full parameters. Shards are new tensors: build the
optimizer over ``shards(model)`` after materializing.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from parts.base.device import accelerator_device
from parts.partition.core.grad_guard import ATTR as _ATTR
from parts.partition.core.param import ParamStatus, alloc, attach_meta, internal, is_partitioned, meta
from parts.partition.core.sharding import reshard

InitFn = Callable[[nn.Module], Any]


def reset_parameters(module: nn.Module) -> None:
    """The default ``init_fn``: the module's own ``reset_parameters()`` where it has one."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def _meta_buffers(module: nn.Module, device: torch.device) -> None:
    """Replace ``module``'s own meta buffers with zeroed ones on ``device`` (``init_fn`` fills them)."""
    for name, buf in list(module.named_buffers(recurse=False)):
        if buf is not None and buf.is_meta:
            module._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype, device=device)


def _unpack(p: nn.Parameter, device: torch.device) -> nn.Parameter:
    """A real parameter for the meta-built ``p``: full zeros on ``device``, a zeroed real shard, ``p``'s record."""
    m = meta(p)
    shard = alloc(m.layout.shard_numel, m.dtype, device).zero_()
    m.shard, m.device = shard.requires_grad_(m.shard.requires_grad), device
    real = nn.Parameter(torch.zeros(m.shape, dtype=m.init_dtype or m.dtype, device=device),
                        requires_grad=p.requires_grad)
    real.__dict__.update({k: v for k, v in p.__dict__.items() if k != _ATTR})
    attach_meta(real, m)
    m.status = ParamStatus.AVAILABLE
    return real


def _swap_in(module: nn.Module, swapped: dict[int, nn.Parameter], device: torch.device) -> list[nn.Parameter]:
    """Replace ``module``'s own meta-built params by real ones (tied ones once); the new ones."""
    fresh = []
    for name, p in list(module._parameters.items()):
        if p is None or not is_partitioned(p) or not (meta(p).shard.is_meta or id(p) in swapped):
            continue
        if id(p) not in swapped:
            swapped[id(p)] = _unpack(p, device)
            fresh.append(swapped[id(p)])
        module._parameters[name] = swapped[id(p)]
    return fresh


@internal
def materialize(model: nn.Module, init_fn: Optional[InitFn] = None,
                device: Optional[torch.device] = None) -> nn.Module:
    """Allocate and initialise the shards of a model built with ``partitioned(device="meta")``."""
    device = torch.device(device) if device is not None else (accelerator_device() or torch.device("cpu"))
    if device.type == "meta":
        raise ValueError("materialize: device must hold data (cpu or an accelerator), got meta")
    init_fn = init_fn or reset_parameters
    swapped: dict[int, nn.Parameter] = {}
    keep_alive = []  # the meta params until every tied use is swapped (ids stay unique)
    for module in model.modules():
        keep_alive.extend(p for p in module.parameters(recurse=False) if id(p) not in swapped)
        params = _swap_in(module, swapped, device)
        _meta_buffers(module, device)
        if not params:
            continue
        with torch.no_grad():
            init_fn(module)
        reshard([(p, meta(p)) for p in params], src=0)
    return model
