"""Per-module method overrides: how ``attach`` gives a module its sharding-aware ``zero_grad``
and ``_apply`` (an instance attribute shadows the class's method) and how ``detach`` takes
them away again, leaving any override that is not ours in place."""

from __future__ import annotations

import types
from typing import Callable, Iterable

from torch import nn


def install_method(modules: Iterable[nn.Module], name: str, function: Callable) -> None:
    """Bind ``function`` as ``module.<name>`` on every module (shadowing the class's method)."""
    for sub in modules:
        sub.__dict__[name] = types.MethodType(function, sub)


def remove_method(modules: Iterable[nn.Module], name: str, function: Callable) -> None:
    """Undo ``install_method``: drop ``module.<name>`` where it is ``function`` bound."""
    for sub in modules:
        bound = sub.__dict__.get(name)
        if getattr(bound, "__func__", None) is function:
            del sub.__dict__[name]


def installed(modules: Iterable[nn.Module], name: str, function: Callable) -> bool:
    """True if any of ``modules`` has ``function`` bound as ``module.<name>`` by ``install_method``."""
    return any(getattr(sub.__dict__.get(name), "__func__", None) is function for sub in modules)
