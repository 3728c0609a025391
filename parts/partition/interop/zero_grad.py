"""``model.zero_grad()`` on an attached model clears the grad shards, as ``optimizer.zero_grad()`` does.

The coordinator moves every gradient into its parameter's grad shard, so torch's
``Module.zero_grad`` (which clears ``p.grad``) alone would leave the grad shards piling up
across steps. ``attach`` puts ``zero_grad`` on every module of the model (an instance
attribute, so the class is untouched); ``detach`` takes it away again. It first lets the
coordinator drop what a failed backward left (full grads pending reduction: coordinator/abort.py),
which would otherwise land in the grad shards after they were cleared.
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable, Optional

from torch import nn

from parts.partition.core import disk
from parts.partition.core.param import internal, is_partitioned, meta
from parts.partition.interop.overrides import install_method, remove_method

_before: "weakref.WeakKeyDictionary[nn.Module, Callable[[], None]]" = weakref.WeakKeyDictionary()
"""Module -> what its coordinator runs before its ``zero_grad`` (``install_zero_grad``); it
configures nothing and forgets dead modules."""


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
    before = _before.get(module)
    if before is not None:
        before()
    with internal:  # torch's version reads p.grad, which raises while a grad shard holds the grad
        type(module).zero_grad(module, set_to_none)
    zero_grad_shards(module.parameters(), set_to_none)


def install_zero_grad(modules: Iterable[nn.Module], before: Optional[Callable[[], None]] = None) -> None:
    """Give every module a ``zero_grad`` that clears its grad shards too (calling ``before()`` first)."""
    modules = list(modules)
    install_method(modules, "zero_grad", _zero_grad)
    for sub in modules if before is not None else ():
        _before[sub] = before


def remove_zero_grad(modules: Iterable[nn.Module]) -> None:
    """Undo ``install_zero_grad`` (modules keep any ``zero_grad`` that is not ours)."""
    modules = list(modules)
    remove_method(modules, "zero_grad", _zero_grad)
    for sub in modules:
        _before.pop(sub, None)
