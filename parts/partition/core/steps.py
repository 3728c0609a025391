"""Optimizer steps on shards: counted, checked, and followed by a refresh of what stays gathered.

Counted. ``is_stale`` compares a shard's version counter with the one it had when its full
tensor was gathered. Fused optimizer kernels (``torch.optim.AdamW(..., fused=True)``, Adam, SGD;
Hugging Face ``Trainer``'s default ``adamw_torch_fused``) write the shards in place without
bumping their version counters, so every shard whose version is taken is linked to its record
(a weak-keyed lookup: nothing is stored on the tensor, which must stay picklable), and one
process-wide optimizer step post-hook (torch's ``register_optimizer_step_post_hook``) adds 1
to ``record.steps`` of every linked shard in the stepped optimizer's param groups; the version
includes that count. A wrapper that steps a copy in the shard's stead and writes it back
(``BF16Optimizer``'s fp32 masters) links the copy to the same record, so its steps count too.

Refreshed. When the outermost optimizer step of a call ends (a wrapper such as
``BF16Optimizer`` or ``OffloadedOptimizer`` steps an inner optimizer: only the wrapper's end
counts), every listener (``listen``: each attached coordinator) is told; one whose own
records' ``steps`` grew gathers again the parameters it keeps gathered whose shards changed,
so any read right after ``step()`` (``state_dict()``, ``named_parameters()``, user code) sees
the stepped values. That is the refresh the next forward would otherwise do: no collective is
added per step. A listener must issue a collective only for its own records: the listeners
are process-wide, and a model dropped without ``detach`` stays one until a garbage collection
that comes at different moments on different ranks.

Checked. A process-wide step pre-hook refuses an optimizer whose param groups hold a sharded
parameter itself (built over ``model.parameters()``): between steps such a parameter holds a
gathered copy or nothing, so its update would be lost. Each optimizer is checked again only
when its number of parameters changes.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from parts.partition.core.grad_guard import ATTR as _ATTR

_links = WeakIdKeyDictionary()
"""Shard -> weak reference to its record. Process-wide because the hook below is; it
configures nothing and forgets shards (keys) and records (values) that are gone."""
_checked = WeakIdKeyDictionary()
"""Optimizer -> number of parameters it held when the pre-hook last found no sharded one."""
_listeners: list[weakref.WeakMethod] = []
"""Bound methods (held weakly) called after each outermost optimizer step."""
_hooks: dict[str, Any] = {}
_before: list[Callable[[torch.optim.Optimizer], None]] = []
"""Functions called with each optimizer before its step (``before_each_step``)."""
_router: list[Any] = []
"""The whole-tensor router (partition/whole/route.py) once imported: settles each optimizer's path
and runs its owners' exchanges around each step."""
_STEP_CODE = torch.optim.Optimizer.profile_hook_step(lambda *args, **kwargs: None).__code__
"""The code of torch's wrapper around every ``Optimizer.step``: a frame running it is a step."""


def _steps_running() -> int:
    """How many optimizer steps the current call stack is inside (nested wrappers count each)."""
    frame, count = sys._getframe(1), 0
    while frame is not None:
        count += frame.f_code is _STEP_CODE
        frame = frame.f_back
    return count


def nested_step() -> bool:
    """True inside an optimizer step that another optimizer's step called (a wrapper's inner optimizer)."""
    return _steps_running() > 1


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Count one step on the record of every linked shard ``optimizer`` holds; after the
    outermost step, tell the listeners."""
    for router in _router:
        router.after(optimizer)
    for group in optimizer.param_groups:
        for t in group["params"]:
            link = _links.get(t)
            record = link() if link is not None else None
            if record is not None:
                record.steps += 1
    if _listeners and _steps_running() <= 1:
        for ref in list(_listeners):
            method = ref()
            if method is None:
                _listeners.remove(ref)
            else:
                method()


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
    """Refuse a step over sharded parameters themselves (not their shards), naming the fix;
    then run the ``before_each_step`` functions; a closure passed to the step comes back wrapped
    by the router (whole/closures.py)."""
    for router in _router:
        router.resolve(optimizer)
    grads_ready(optimizer)
    for router in _router:
        router.before(optimizer)
    _check_params(optimizer)
    return _router[0].wrap(optimizer, args, kwargs) if _router else None


def _check_params(optimizer: torch.optim.Optimizer) -> None:
    groups = optimizer.param_groups
    size = sum(len(g["params"]) for g in groups)
    if _checked.get(optimizer) == size:
        return
    for group in groups:
        for p in group["params"]:
            record = getattr(p, "__dict__", {}).get(_ATTR)
            if record is not None:
                raise RuntimeError(_full_param_message(optimizer, record))
    _checked[optimizer] = size


def grads_ready(optimizer: torch.optim.Optimizer) -> None:
    """Run the ``before_each_step`` functions: what must land in the grad shards before ``optimizer``
    reads them (before its step, and after each closure its step calls)."""
    for fn in _before:
        fn(optimizer)


def _full_param_message(optimizer: torch.optim.Optimizer, record: Any) -> str:
    name = type(optimizer).__name__
    return (f"parts.partition: {name}.step() steps {record.describe()} itself, but the parameters "
            f"of a sharded model hold a gathered copy or nothing between steps, so the update "
            f"would be lost. Build the optimizer over the shards: "
            f"`{name}(parts.partition.shards(model), ...)`, or call "
            f"parts.partition.use_shards(optimizer) right after building it")


def install() -> None:
    """Register the process-wide step hooks (once): counting, refreshing, refusing full params."""
    if not _hooks:
        _hooks["post"] = register_optimizer_step_post_hook(_after_step)
        _hooks["pre"] = register_optimizer_step_pre_hook(_before_step)


def before_each_step(fn: Callable[[torch.optim.Optimizer], None]) -> None:
    """Call ``fn(optimizer)`` before every optimizer step from now on (registering twice is once):
    what must land in the grad shards before a step reads them (core/replicas.py)."""
    install()
    if fn not in _before:
        _before.append(fn)


def watch(shard: torch.Tensor, record: Any) -> None:
    """Link ``shard`` (or a copy stepped in its stead) to ``record`` (optimizer steps on it count
    in ``record.steps``)."""
    link = _links.get(shard)
    if link is None or link() is not record:
        _links[shard] = weakref.ref(record)
    install()


def linked_record(shard: torch.Tensor) -> Any:
    """The record ``watch`` linked ``shard`` to (None if none)."""
    link = _links.get(shard)
    return link() if link is not None else None


def set_router(router: Any) -> None:
    """Install the whole-tensor router (``resolve``, ``before``, ``after``, ``held`` and ``wrap`` of an optimizer)."""
    install()
    _router[:] = [router]


def held_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors ``optimizer`` steps: its param groups', and the shards its owners step whole."""
    held = [t for group in optimizer.param_groups for t in group["params"]]
    for router in _router:
        held.extend(router.held(optimizer))
    return held


def listen(method: Callable[[], None]) -> None:
    """Call bound ``method`` (held weakly) after every outermost optimizer step."""
    install()
    _listeners.append(weakref.WeakMethod(method))


def unlisten(method: Callable[[], None]) -> None:
    """Stop calling ``method``."""
    _listeners[:] = [ref for ref in _listeners if ref() is not None and ref() != method]
