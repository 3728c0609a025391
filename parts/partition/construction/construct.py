"""Shard parameters as a model is built: ``partitioned(...)`` and ``partition_module``.

Mechanism (and why). Inside ``partitioned`` every ``nn.Module`` subclass's own
``__init__`` is wrapped (classes defined inside the context too, via
``__init_subclass__``); when the *outermost* ``__init__`` of an object returns, all of its
parameters not yet sharded are broadcast from group rank 0 and sharded (one collective
per module). So a 78-layer stack never holds more than the shards plus one layer.

Parents that re-initialise children after those were sharded (nanoGPT's
``self.apply(self._init_weights)``, Hugging Face ``post_init``, ``reset_parameters()``, an
in-place ``nn.init.*_`` on a child's weight, ``w.data.normal_()``) keep working through a
``TorchFunctionMode`` (``_intercept``): any torch call touching a released parameter first
gathers it, runs on the real full tensor with the real RNG, and the touched parameter is
re-sharded (rank 0's values) when the innermost frame ends: an ``nn.init`` call, one
``fn(module)`` of ``Module.apply`` (patched to open a frame), a constructor, the context.
Shape queries are answered from the record without gathering. Alternatives rejected:
keeping params full until the outermost constructor ends breaks the memory bound; a
meta-device build cannot replay an init function that reads other parameters; patching
only ``nn.init`` misses ``.data.normal_()`` and friends. Since each rank runs the same
init code with its own generator and nothing here draws random numbers, rank 0 (and a
world-1 build) ends bitwise equal to the plain build with rank 0's seed.

Patches (``__init__`` wrappers, ``Module.apply``, ``Module.register_parameter``,
``Module.__init_subclass__``, the mode) are installed by the outermost active context and
all removed on its exit; nothing leaks. Parameters registered later (``register_parameter``
or attribute assignment on a module built in the context) are sharded at once while the
context is active. Parameters on the meta device are placeholders and stay unsharded: Hugging
Face's ``from_pretrained`` builds the model on meta and then assigns each loaded weight
(``setattr``), which shards it at once, so ``with partitioned(): from_pretrained(...)`` never
holds more than one full weight per rank. Buffers stay full and are broadcast from rank 0. A module owning
sharded parameters gets a forward pre-hook that raises, naming the parameter and the
module, if one is not gathered (fetch hooks of a coordinator must use ``prepend=True``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import torch
from torch import nn

from parts.partition.construction import intercept as _intercept
from parts.comm import GroupArg, GroupInfo, Topology, broadcast, hybrid_groups, launcher_ranks_per_node
from parts.comm.agree import agree_on_layout
from parts.partition.core.param import ParamStatus, internal, is_partitioned, meta
from parts.partition.core.sharding import ShardSpec, shard_params

_SPEC, _DISABLED, _NAME, _HOOK = "_parts_spec", "_parts_disabled", "_parts_name", "_parts_check_hook"


class _State:
    """Patches and bookkeeping shared by all active ``partitioned`` contexts."""

    def __init__(self) -> None:
        self.configs: list[Optional[ShardSpec]] = []  # None = an enabled=False context
        self.building: dict[int, list] = {}  # id(module) -> [init depth, spec]
        self.restore: list[tuple[type, str, Any, Any]] = []  # (class, name, value before, ours)
        self.mode: Optional[_intercept.Interceptor] = None


_state = _State()
"""Process-wide because what it records is: ``partitioned`` patches ``nn.Module`` itself (its
subclasses' ``__init__``, ``apply``, ``register_parameter``) for every thread, and nested
contexts share those patches. Nothing to configure; empty whenever no context is active."""

_on_sharded: list[Callable[[list[nn.Module]], None]] = []
"""What runs on the modules of every tree sharded at construction. Layers above construction
register here (interop gives a Hugging Face model a shard-aware ``resize_token_embeddings``),
so construction imports none of them."""


def on_sharded(fn: Callable[[list[nn.Module]], None]) -> Callable[[list[nn.Module]], None]:
    """Run ``fn(modules)`` on every module tree sharded from now on (registering twice is once)."""
    if fn not in _on_sharded:
        _on_sharded.append(fn)
    return fn


def _owned(module: nn.Module):
    """``(param_name, module_name, owner, p)`` for every distinct parameter under ``module``."""
    seen: set[int] = set()
    for mod_name, mod in module.named_modules(remove_duplicate=True):
        for name, p in mod._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield (f"{mod_name}.{name}" if mod_name else name), mod_name, mod, p


def _check_available(module: nn.Module, args: Any) -> None:
    """Forward pre-hook: raise naming the parameter and module if a sharded param is released."""
    for p in module._parameters.values():
        if p is not None and is_partitioned(p) and meta(p).status is not ParamStatus.AVAILABLE:
            m = meta(p)
            raise RuntimeError(
                f"parts.partition: {m.describe()} is {m.status.value} in the forward of module "
                f"'{module.__dict__.get(_NAME, '')}' ({type(module).__name__}); gather it first "
                f"(parts.partition.gather, gathered(...), or attach a FetchCoordinator)")


def _check_loadable(module: nn.Module, state_dict: Any, prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook: a released sharded param cannot take a full tensor; say what can."""
    for name, p in module._parameters.items():
        if p is not None and is_partitioned(p) and meta(p).status is not ParamStatus.AVAILABLE \
                and prefix + name in state_dict:
            raise RuntimeError(
                f"parts.partition: load_state_dict into sharded {meta(p).describe()} (key "
                f"'{prefix + name}'), which is {meta(p).status.value}; use "
                f"parts.partition.load_full_state_dict(model, sd), or load inside "
                f"`with gathered(model.parameters(), modifier_rank=0):`")


def _add_hooks(mod: nn.Module) -> None:
    """The forward and load-state-dict checks of a module owning sharded params (once)."""
    if _HOOK not in mod.__dict__:
        mod.__dict__[_HOOK] = (mod.register_forward_pre_hook(_check_available),
                               mod.register_load_state_dict_pre_hook(_check_loadable))


def drop_forward_check(mod: nn.Module) -> None:
    """Remove ``mod``'s forward check (a fused compiled block gathers for it: compiled.py)."""
    hooks = mod.__dict__.get(_HOOK)
    if hooks is not None and hooks[0] is not None:
        hooks[0].remove()
        mod.__dict__[_HOOK] = (None, hooks[1])


def restore_forward_check(mod: nn.Module) -> None:
    """Put back a forward check that ``drop_forward_check`` removed."""
    hooks = mod.__dict__.get(_HOOK)
    if hooks is not None and hooks[0] is None:
        mod.__dict__[_HOOK] = (mod.register_forward_pre_hook(_check_available), hooks[1])


def _adopt(module: nn.Module, spec: ShardSpec) -> None:
    """Shard ``module``'s unsharded params, sync its buffers, name records, add check hooks."""
    todo = [(q, p) for q, _, mod, p in _owned(module)
            if not is_partitioned(p) and not mod.__dict__.get(_DISABLED) and (spec.on_meta or not p.is_meta)]
    shard_params(todo, spec)
    _name_records(module)
    _sync_buffers(module, spec.info)
    if spec.replica is not None:
        _sync_buffers(module, spec.replica)
    modules = list(module.modules())
    for fn in _on_sharded:
        fn(modules)


def _name_records(module: nn.Module) -> None:
    """Name every module and sharded param's record after its place in ``module``; add checks."""
    for mod_name, mod in module.named_modules():
        mod.__dict__[_NAME] = mod_name
    for qname, mod_name, mod, p in _owned(module):
        if is_partitioned(p):
            m = meta(p)
            m.name, m.module_name, m.module_type = qname, mod_name, type(mod).__name__
            _add_hooks(mod)


@internal
def shard_new(module: nn.Module, params: list[nn.Parameter], spec: ShardSpec) -> None:
    """Shard ``params`` (unsharded params of ``module``; rank 0's values), named as ``_adopt`` does."""
    names = {id(p): q for q, _, _, p in _owned(module)}
    shard_params([(names[id(p)], p) for p in params], spec)
    _name_records(module)


def _sync_buffers(module: nn.Module, info: GroupInfo) -> None:
    """Broadcast the module's buffers from group rank 0 (one collective per dtype)."""
    if info.world_size == 1:
        return
    bufs = [b for b in module.buffers() if b is not None and b.numel() and not b.is_meta]
    for dtype in sorted({b.dtype for b in bufs}, key=str):
        group = [b for b in bufs if b.dtype == dtype]
        flat = torch.cat([b.detach().reshape(-1) for b in group])
        broadcast(flat, 0, info)
        off = 0
        for b in group:
            with torch.no_grad():
                b.copy_(flat[off:off + b.numel()].view_as(b))
            off += b.numel()


# ----------------------------------------------------------------- patches
def _enter_init(module: nn.Module) -> None:
    entry = _state.building.get(id(module))
    if entry is None:
        _state.building[id(module)] = [1, _state.configs[-1] if _state.configs else None]
        _intercept.push_frame()
    else:
        entry[0] += 1


@internal
def _after_init(module: nn.Module, spec: Optional[ShardSpec]) -> None:
    if spec is None:
        module.__dict__[_DISABLED] = True
        return
    module.__dict__[_SPEC] = spec
    _adopt(module, spec)


def _exit_init(module: nn.Module, ok: bool) -> None:
    entry = _state.building[id(module)]
    entry[0] -= 1
    if entry[0]:
        return
    del _state.building[id(module)]
    _intercept.pop_frame(ok)
    if ok:
        _after_init(module, entry[1])


def _wrap_init(cls: type) -> None:
    orig = cls.__dict__.get("__init__")
    if orig is None or getattr(orig, "_parts_wrapped", False) or not callable(orig):
        return

    @functools.wraps(orig)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        if _state.mode is None:  # kept after the context by a decorator that wrapped it (below)
            orig(self, *args, **kwargs)
            return
        _enter_init(self)
        ok = False
        try:
            orig(self, *args, **kwargs)
            ok = True
        finally:
            _exit_init(self, ok)

    __init__._parts_wrapped = True
    try:
        type.__setattr__(cls, "__init__", __init__)
    except TypeError:  # an immutable (extension) type: its modules are adopted by their parents
        return
    _state.restore.append((cls, "__init__", orig, __init__))


def _init_subclass(cls: type, **kwargs: Any) -> None:
    super(nn.Module, cls).__init_subclass__(**kwargs)
    _wrap_init(cls)


def _apply(self: nn.Module, fn: Any) -> nn.Module:
    for child in self.children():
        child.apply(fn)
    with _intercept.frame():
        fn(self)
    return self


def _register_parameter(self: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
    _ORIG_REGISTER(self, name, param)
    spec = self.__dict__.get(_SPEC)
    if param is None or spec is None or id(self) in _state.building or is_partitioned(param) \
            or (param.is_meta and not spec.on_meta):  # a placeholder (from_pretrained): values come later
        return
    with internal:
        prefix = self.__dict__.get(_NAME, "")
        shard_params([(f"{prefix}.{name}" if prefix else name, param)], spec)
        meta(param).module_name, meta(param).module_type = prefix, type(self).__name__
        _add_hooks(self)


_ORIG_REGISTER = nn.Module.register_parameter


def _module_classes() -> list[type]:
    seen, stack = [], [nn.Module]
    while stack:
        cls = stack.pop()
        if cls not in seen:
            seen.append(cls)
            stack.extend(cls.__subclasses__())
    return seen


def _install() -> None:
    for cls in _module_classes():
        _wrap_init(cls)
    for name, value in (("apply", _apply), ("register_parameter", _register_parameter),
                        ("__init_subclass__", classmethod(_init_subclass))):
        _state.restore.append((nn.Module, name, nn.Module.__dict__.get(name), value))
        type.__setattr__(nn.Module, name, value)
    _state.mode = _intercept.Interceptor()
    _state.mode.__enter__()
    _intercept.push_frame()


def _uninstall(ok: bool) -> None:
    try:
        _intercept.pop_frame(ok)
    finally:
        _state.mode.__exit__(None, None, None)
        _state.mode = None
        for cls, name, value, ours in reversed(_state.restore):
            if cls.__dict__.get(name) is not ours:
                # Replaced since: a class defined inside the context (a lazy import) whose
                # decorator wrapped our __init__ (Hugging Face kernels' use_kernelized_func);
                # restoring would drop the decoration. Ours stays inside theirs, inert now.
                continue
            if value is None:
                type.__delattr__(cls, name)
            else:
                type.__setattr__(cls, name, value)
        _state.restore.clear()
        _state.building.clear()


# ----------------------------------------------------------------- public
class partitioned:
    """Context manager: every module built inside has its parameters sharded after its ``__init__``.

    A hybrid layout: ``replicate_group`` (or ``mesh``, a 2-D ``DeviceMesh`` with dims
    (replicate, shard) as FSDP2 takes it) keeps the shards on ``group`` and one copy of them
    on every member of ``replicate_group``; grad shards are averaged across it.
    ``ranks_per_node``: the shard group spans nodes of that many ranks (node after node); its
    all-gathers and reduce-scatters then cross between nodes once per byte
    (``parts.comm.topology``). By default it is the launcher's ``LOCAL_WORLD_SIZE`` when the
    shard group spans several whole nodes of it; 1 keeps every collective flat."""

    def __init__(self, group: GroupArg = None, *, dtype: Optional[torch.dtype] = None,
                 device: Any = None, remote_device: Any = None, pin_memory: bool = False,
                 enabled: bool = True, replicate_group: GroupArg = None, mesh: Any = None,
                 ranks_per_node: Optional[int] = None) -> None:
        self.enabled = enabled
        self._args = (group, dtype, device, remote_device, pin_memory)
        self._hybrid = (replicate_group, mesh, ranks_per_node)
        self._pushed = False
        self._meta_device: Optional[torch.device] = None  # entered while building on meta

    def __enter__(self) -> "partitioned":
        group, dtype, device, remote_device, pin_memory = self._args
        spec = (_spec(group, *self._hybrid, dtype, device, remote_device, pin_memory)
                if self.enabled else None)
        if not _state.configs and not self.enabled:
            return self  # a plain build: nothing to patch
        if not _state.configs:
            _install()
        _state.configs.append(spec)
        self._pushed = True
        if spec is not None and spec.on_meta:  # build without data: parameters are created on meta
            self._meta_device = torch.device("meta")
            self._meta_device.__enter__()
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if not self._pushed:
            return
        self._pushed = False
        if self._meta_device is not None:
            self._meta_device.__exit__(exc_type, *exc)
            self._meta_device = None
        _state.configs.pop()
        if not _state.configs:
            _uninstall(exc_type is None)


def _spec(group: GroupArg, replicate_group: GroupArg, mesh: Any, ranks_per_node: Optional[int],
          *args: Any) -> ShardSpec:
    """The ``ShardSpec`` of a call: shards over ``group`` (or the mesh's shard dim), replicated
    over ``replicate_group`` (or the mesh's replicate dim) when there is one; all-gathers in two
    hops with ``ranks_per_node``."""
    on_meta = args[1] is not None and torch.device(args[1]).type == "meta"  # no values shared: attach checks
    info, replica = (hybrid_groups if on_meta else agree_on_layout)(group, replicate_group, mesh, "parts.partition")
    if ranks_per_node is None:
        ranks_per_node = launcher_ranks_per_node(info.global_ranks())
    if ranks_per_node is not None and info.world_size > 1:
        info = dataclasses.replace(info, topology=Topology.build(info, ranks_per_node))
    return ShardSpec(info, *args, replica=replica)


@internal
def partition_module(module: nn.Module, group: GroupArg = None, *, dtype: Optional[torch.dtype] = None,
                     device: Any = None, remote_device: Any = None, pin_memory: bool = False,
                     replicate_group: GroupArg = None, mesh: Any = None,
                     ranks_per_node: Optional[int] = None) -> nn.Module:
    """Shard an existing module's parameters in place (rank 0's values); returns ``module``.
    ``replicate_group``/``mesh``/``ranks_per_node``: as for ``partitioned``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"partition_module: expected an nn.Module, got {type(module).__name__}")
    spec = _spec(group, replicate_group, mesh, ranks_per_node, dtype, device, remote_device, pin_memory)
    _adopt(module, spec)
    return module
