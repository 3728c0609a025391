"""The one place that papers over differences between torch versions (>= 2.4) and that
touches torch internals.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``; older releases only have the former.
``parts.comm`` calls these wrappers (uncounted: it counts bytes itself).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
# torch.distributed.nn.functional binds ``group=group.WORLD`` as default arguments when first
# imported. Imported after init_process_group (torch.optim's first optimizer imports it through
# torch.distributed.fsdp), its functions keep the default process group alive, so
# destroy_process_group cannot free it and gloo's threads run on into interpreter teardown
# and abort the exit. Imported here, before any group exists, those defaults are None.
import torch.distributed.nn.functional  # noqa: F401
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode  # for parts.observe

TENSOR_BASE = torch._C.TensorBase
"""The C base class of ``torch.Tensor`` (the ``__objclass__`` of its methods)."""

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(output: torch.Tensor, input: torch.Tensor,
                    group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Any:
    """All-gather equal 1-D chunks ``input`` of every rank into ``output`` (rank order). The
    collective sees detached tensors: a backend that writes on its own thread (where grad mode is
    on) must not meet a shard that requires grad."""
    return _ALL_GATHER(output.detach(), input.detach(), group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                        group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Any:
    """Reduce ``input`` (world_size equal chunks) across ranks; this rank's chunk lands in ``output``."""
    return _REDUCE_SCATTER(output.detach(), input.detach(), op=op, group=group, async_op=async_op)


def foreach_norm(tensors: list[torch.Tensor], ord: float, dtype: torch.dtype) -> list[torch.Tensor]:
    """The ``ord`` norm of each tensor (of one device) in ``dtype``, in one kernel where torch has one."""
    return list(torch._foreach_norm(tensors, ord, dtype=dtype))


_SWAP_DATA = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)


def can_swap_storage_data() -> bool:
    """True if this torch can move the memory of one storage into another (``swap_storage_data``)."""
    return _SWAP_DATA is not None


def swap_storage_data(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory (pointer and byte size) of storages ``a`` and ``b``; tensors and
    views on either keep their storage object and see the other's bytes."""
    _SWAP_DATA(a, b)


# ------------------------------------------------------------ torch internals, used only here
def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (a graph task) on this thread."""
    return torch._C._current_graph_task_id() != -1


def graph_task_id() -> int:
    """The id of the backward pass (graph task) running on this thread, -1 outside backward;
    every ``backward()`` / ``autograd.grad()`` call gets a new one."""
    return torch._C._current_graph_task_id()


def on_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass (graph task) finishes."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


default_torch_function: Callable[[Callable, Any, tuple, dict], Any] = torch._C._disabled_torch_function_impl
"""``default_torch_function(func, types, args, kwargs)``: what ``torch.Tensor.__torch_function__``
does without subclass handling (plain dispatch); torch's own function, so a subclass's
``__torch_function__`` (every op on a grad shard) pays no extra Python frame."""


def incompatible_keys(missing: list[str], unexpected: list[str]) -> Any:
    """The ``(missing_keys, unexpected_keys)`` named tuple ``nn.Module.load_state_dict`` returns."""
    return _IncompatibleKeys(missing, unexpected)


def init_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    """The hook dicts ``torch.optim.Optimizer.__init__`` creates, for a wrapper that cannot
    run that ``__init__`` (its ``param_groups``/``state``/``defaults`` are the wrapped optimizer's)."""
    for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                 "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                 "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
        setattr(optimizer, name, OrderedDict())


def dynamo_counters() -> dict:
    """Frames torch.compile compiled, distinct graphs and graph breaks since ``torch.compiler.reset()``."""
    from torch._dynamo.utils import counters
    return {"frames": counters["frames"]["ok"], "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "break_reasons": sorted(counters["graph_break"])}


def counting_backend(name: str = "inductor") -> tuple[Callable, list]:
    """A ``torch.compile`` backend that is ``name``'s, and a one-item list counting how many
    times the compiled graphs it produced ran (so a silent fallback to eager shows)."""
    from torch._dynamo import lookup_backend
    inner, calls = lookup_backend(name), [0]

    def backend(gm: Any, example_inputs: Any) -> Callable:
        compiled = inner(gm, example_inputs)

        def run(*args: Any) -> Any:
            calls[0] += 1
            return compiled(*args)

        run._boxed_call = getattr(compiled, "_boxed_call", False)
        return run

    return backend, calls


def alias_as(cls: type, t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """An instance of the tensor subclass ``cls`` over ``t``'s storage (a leaf sharing its data and
    version counter): ``parts.partition``'s shape-faithful shard leaves."""
    return torch.Tensor._make_subclass(cls, t.detach(), requires_grad)


def storage_less_tensor(cls: type, shape: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An instance of the tensor subclass ``cls`` with ``shape``/``dtype``/``device`` and no storage
    (``parts.comm.dcp.ShardView``: its data lives in the tensors it points to)."""
    return torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device,
                                               requires_grad=False)


def functorch_active() -> bool:
    """True while a ``torch.func`` transform (grad, vjp, vmap, jvp...) runs on this thread."""
    return torch._C._are_functorch_transforms_active()


def outside_functorch(fn: Callable) -> Callable:
    """``fn`` run with ``torch.func`` transforms switched off while one is active (as FSDP2's
    unshard and reshard are): tensors it makes are plain, not wrapped at the transform's level."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch._C._are_functorch_transforms_active():
            with torch._C._DisableFuncTorch():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return run


def functorch_unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The tensor inside every ``torch.func`` wrapper around ``t`` (``t`` itself if unwrapped)."""
    from torch._C import _functorch
    while _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    return t


try:  # the C half of dynamo, loaded with torch (importing torch._dynamo itself takes seconds)
    from torch._C._dynamo import eval_frame as _eval_frame
except ImportError:  # a build without dynamo: nothing can trace the hooks
    _eval_frame = None


def _skip_frames_of(code: Any) -> None:
    """Dynamo's ``skip_code``: frames running ``code`` are never converted."""
    if hasattr(_eval_frame, "set_code_exec_strategy"):
        action = _eval_frame._FrameAction
        _eval_frame.set_code_exec_strategy(code, _eval_frame._FrameExecStrategy(action.SKIP, action.DEFAULT))
    elif hasattr(_eval_frame, "skip_code"):
        _eval_frame.skip_code(code)


def never_compiled(fn: Callable, reason: str) -> Callable:
    """``fn`` as ``torch.compiler.disable(fn, reason=reason)`` makes it (a graph break where
    dynamo traces a caller, run eagerly with dynamo off inside), without importing torch._dynamo."""
    if _eval_frame is None:
        return fn

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        prior = _eval_frame.set_eval_frame(None)
        try:
            return fn(*args, **kwargs)
        finally:
            _eval_frame.set_eval_frame(prior)

    _skip_frames_of(run.__code__)
    run._torchdynamo_disable, run._torchdynamo_disable_msg = True, reason
    run._torchdynamo_orig_callable = fn
    return run


def default_store() -> Any:
    """The default process group's key-value store (torch keeps the accessor private)."""
    return dist.distributed_c10d._get_default_store()
