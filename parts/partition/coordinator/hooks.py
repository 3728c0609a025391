"""Hook plumbing of the fetch coordinator: module hooks, output tensor hooks, parameter watch.

Nothing here decides what to fetch; ``FetchCoordinator`` (coordinator.py) does. This module
installs and removes the hooks and finds tensors inside whatever a forward returns. The hooks
are ``eager``: under ``torch.compile`` each is a graph break, run with dynamo off (compiled.py),
and under a ``torch.func`` transform they run with it switched off (transforms.py).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from parts._compat import graph_task_id, never_compiled, outside_functorch


_MAX_DEPTH = 8

EAGER_REASON = (
    "parts: the fetch coordinator's hooks gather and release sharded parameters (collectives) "
    "and run eagerly between compiled regions, so an attached model compiles with a graph break "
    "at each fetch unit. fullgraph=True cannot hold them: compile without fullgraph, or compile "
    "one graph per block with parts.partition.compile_blocks(model, blocks, fullgraph=True)")


def eager(fn: Callable) -> Callable:
    """``fn`` (a coordinator hook) run eagerly where ``torch.compile`` traces its caller, and
    outside any ``torch.func`` transform: the tensors it gathers are plain (transforms.py)."""
    return never_compiled(outside_functorch(fn), EAGER_REASON)


def tensors_in(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside ``obj``: tensors, lists, tuples (named too), dicts and dataclasses, nested."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth >= _MAX_DEPTH:
        return
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name, None), depth + 1)


def register_pre_backward(output: Any, fire: Callable[[], None]) -> bool:
    """Call ``fire()`` once per backward pass through ``output``, when the first grad w.r.t.
    one of its tensors is computed (again in a second pass through a retained graph).

    Returns False (and registers nothing) if no tensor in ``output`` requires grad.
    """
    tensors = [t for t in tensors_in(output) if t.requires_grad]
    if not tensors:
        return False
    state = {"pass": None}

    def hook(*_: Any) -> None:
        current = graph_task_id()
        if state["pass"] != current:
            state["pass"] = current
            fire()

    nodes = {}
    for t in tensors:
        node = t.grad_fn
        if node is None:  # a leaf returned as is: hook the tensor itself
            t.register_hook(hook)
        elif node not in nodes:  # a pre-hook on the node runs before it computes input grads
            nodes[node] = node.register_prehook(hook)
    return True


class UnitFlag:
    """Whether a fetch unit is the innermost module running forward (``RunningUnits``)."""

    __slots__ = ("running",)

    def __init__(self) -> None:
        self.running = False


class RunningUnits:
    """One ``UnitFlag`` per watched unit, True for the unit on top of the coordinator's stack.

    A watched read by the running unit itself is no external use: the flag skips the call
    into the coordinator, and under ``torch.compile`` it keeps a block's own parameter reads
    inside its graph (dynamo guards on the flag's value, the same for every block).
    """

    def __init__(self) -> None:
        self.flags: dict[int, UnitFlag] = {}
        self.top: Optional[int] = None

    def flag(self, unit: int) -> UnitFlag:
        """The flag of ``unit`` (made on first request)."""
        flag = self.flags.get(unit)
        if flag is None:
            flag = self.flags[unit] = UnitFlag()
            flag.running = unit == self.top
        return flag

    def mark(self, top: Optional[int]) -> None:
        """``top`` (a unit index, None outside forward) is now the innermost running unit."""
        if top == self.top:
            return
        for index, running in ((self.top, False), (top, True)):
            flag = self.flags.get(index)
            if flag is not None:
                flag.running = running
        self.top = top


class WatchedParameters(dict):
    """A module's ``_parameters`` that reports reads made while another module runs forward.

    ``module.weight`` goes through ``nn.Module.__getattr__`` to ``_parameters[name]``; when
    the coordinator's running module is not the owner, the read is an external use (a tied
    output projection ``F.linear(x, self.wte.weight)``): ``on_read(owner_index, param)``
    fetches the parameter and remembers it for that module.
    """

    __slots__ = ("owner_index", "on_read", "unit")

    def __init__(self, items: dict, owner_index: int, on_read: Callable[[int, Any], None],
                 unit: UnitFlag) -> None:
        super().__init__(items)
        self.owner_index, self.on_read, self.unit = owner_index, on_read, unit

    def __getitem__(self, name: str) -> Any:
        value = dict.__getitem__(self, name)
        if value is not None and not self.unit.running:
            self.on_read(self.owner_index, value)
        return value


@dataclasses.dataclass
class ModuleHooks:
    """The hooks the coordinator installed on one module, so they can be removed."""

    module: nn.Module
    handles: list = dataclasses.field(default_factory=list)
    watched: bool = False
    light: bool = False  # forward hooks that fetch only outside any other forward (coordinator.py)

    def install(self, pre: Callable, post: Callable) -> None:
        """Forward pre-hook (prepended: fetch runs before any check) and always-called post-hook."""
        self.handles.append(self.module.register_forward_pre_hook(pre, prepend=True))
        self.handles.append(self.module.register_forward_hook(post, always_call=True))

    def watch(self, owner_index: int, on_read: Callable[[int, Any], None], unit: UnitFlag) -> None:
        """Replace the module's ``_parameters`` with a ``WatchedParameters`` of the same items."""
        params = self.module.__dict__["_parameters"]
        self.module.__dict__["_parameters"] = WatchedParameters(dict(params), owner_index, on_read, unit)
        self.watched = True

    def remove(self) -> None:
        """Remove the hooks and give the module back a plain ``_parameters`` dict."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.unwatch()

    def unwatch(self) -> None:
        """Give the module back a plain ``_parameters`` dict (reads are no longer reported)."""
        if self.watched:
            params = self.module.__dict__["_parameters"]
            self.module.__dict__["_parameters"] = dict(params.items())
            self.watched = False


class AttachedLookup:
    """module -> its coordinator, holding neither strongly.

    A ``WeakKeyDictionary`` with the coordinator as a plain value never forgets anything: the
    coordinator references its modules, so every key stays alive through its own value, and
    an attached model (with its process group and gloo threads) outlived ``del model`` and
    ``destroy_process_group`` until interpreter teardown. Here the value is
    a weak reference too; the coordinator lives as long as its hooks on the model do.
    """

    def __init__(self) -> None:
        self._refs: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()

    def get(self, module: nn.Module) -> Optional[Any]:
        """The live coordinator attached to ``module``, or None."""
        ref = self._refs.get(module)
        return ref() if ref is not None else None

    def __contains__(self, module: nn.Module) -> bool:
        return self.get(module) is not None

    def __setitem__(self, module: nn.Module, coordinator: Any) -> None:
        self._refs[module] = weakref.ref(coordinator)

    def __delitem__(self, module: nn.Module) -> None:
        del self._refs[module]
