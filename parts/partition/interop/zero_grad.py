"""``model.zero_grad()`` on an attached model clears the grad shards, as ``optimizer.zero_grad()`` does.

The coordinator moves every gradient into its parameter's grad shard, so torch's
``Module.zero_grad`` (which clears ``p.grad``) alone would leave the grad shards piling up
across steps. ``attach`` puts ``zero_grad`` on every module of the model (an instance
attribute, so the class is untouched); ``detach`` takes it away again.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from parts.partition.core import disk
from parts.partition.core.param import internal, is_partitioned, meta
from parts.partition.interop.overrides import install_method, remove_method


def zero_grad_shards(params: Iterable[nn.Parameter], set_to_none: bool = True) -> None:
    """Clear (or zero in place) the grad shards of the sharded ones among ``params``."""
    for p in params:
        if not is_partitioned(p):
            continue
        m = meta(p)
        disk.clear_grad(m.shard)
        grad = m.grad_shard
        if grad is None:
            continue
        if set_to_none:
            m.grad_shard = None
        else:
            grad.zero_()


def _zero_grad(module: nn.Module, set_to_none: bool = True) -> None:
    """torch's ``Module.zero_grad``, then the grad shards of ``module``'s parameters."""
    with internal:  # torch's version reads p.grad, which raises while a grad shard holds the grad
        type(module).zero_grad(module, set_to_none)
    zero_grad_shards(module.parameters(), set_to_none)


def install_zero_grad(modules: Iterable[nn.Module]) -> None:
    """Give every module a ``zero_grad`` that clears its grad shards too."""
    install_method(modules, "zero_grad", _zero_grad)


def remove_zero_grad(modules: Iterable[nn.Module]) -> None:
    """Undo ``install_zero_grad`` (modules keep any ``zero_grad`` that is not ours)."""
    remove_method(modules, "zero_grad", _zero_grad)
