"""The guard class of a released parameter: ``ReleasedParameter`` raises, naming the parameter,
for every op that reads data, and answers shape queries with the full values from its record
(core/param.py says when a parameter has this class); ``ReleasedData`` is its ``p.data`` in user
code, whose data ops raise."""

from __future__ import annotations

import enum
from typing import Any, Optional

import torch

from parts._compat import default_torch_function
from parts.partition.core.grad_guard import ATTR as _ATTR
from parts.partition.core.grad_guard import ShardedParameter, in_internal


class ParamStatus(enum.Enum):
    """Whether a sharded parameter's full tensor is in ``p.data``."""

    AVAILABLE = "available"
    NOT_AVAILABLE = "not_available"
    INFLIGHT = "inflight"


def meta(p: torch.Tensor) -> Any:
    """The record of a sharded parameter (core/param.py's ``meta`` without its check)."""
    return p.__dict__[_ATTR]


_VIEW_ATTRS = frozenset({"T", "mT", "H", "mH", "real", "imag"})
_META_METHODS = frozenset({
    "size", "dim", "numel", "nelement", "ndimension", "element_size", "is_floating_point",
    "is_complex", "is_signed", "is_contiguous", "is_pinned", "is_shared", "is_inference",
    "get_device", "stride", "storage_offset", "untyped_storage", "data_ptr", "has_names", "_is_view",
    "requires_grad_",
    "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "__hash__", "__dir__",
    "__format__", "__sizeof__",
    "grad", "backward"})  # torch.autograd.grad/backward(inputs=...): the param names a graph leaf


def _attr_name(func: Any) -> Optional[str]:
    """The attribute name if ``func`` is a tensor attribute's getter/setter, else None."""
    if getattr(func, "__name__", "") in ("__get__", "__set__", "__delete__"):
        return getattr(getattr(func, "__self__", None), "__name__", None)
    return None


def _reads_data(func: Any) -> bool:
    """False for metadata access (attributes but views, shape queries, hooks), True otherwise."""
    attr = _attr_name(func)
    if attr is not None:
        return attr in _VIEW_ATTRS
    return getattr(func, "__name__", "") not in _META_METHODS


_PREFIXES = {"TensorBase": "Tensor", "_VariableFunctionsClass": "torch", "_TensorBase": "Tensor"}


def _op_name(func: Any) -> str:
    """``Tensor.add``, ``torch.cat``, ``linear``...: the op's name for an error message."""
    attr = _attr_name(func)
    if attr is not None:
        return f"Tensor.{attr}"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    head, dot, tail = name.partition(".")
    return f"{_PREFIXES[head]}.{tail}" if dot and head in _PREFIXES else name


def _released_message(p: torch.Tensor, what: str, by_op: bool = False) -> str:
    m = meta(p)
    ranks = f"{m.world_size} rank{'s' if m.world_size != 1 else ''}"
    state = (f"still being gathered (sharded over {ranks}; wait() its GatherHandle first)"
             if m.status is ParamStatus.INFLIGHT else f"released (sharded over {ranks}; p.data is empty)")
    if by_op and m.attached:  # a coordinator fetches it for its own module's forward and backward only
        return (f"parts.partition: {m.describe()} is {state}; {what} cannot use it. Its model is "
                f"attached, and a module whose forward uses a parameter it does not own (kept in a list "
                f"or a plain attribute) must declare it once, on every rank: "
                f"`parts.partition.register_external_parameter(module, param)`. Outside a forward, read "
                f"it inside `with parts.partition.gathered(params):` or with parts.partition.full_state_dict")
    return (f"parts.partition: {m.describe()} is {state}; {what} cannot use it. Gather it first: "
            f"`with parts.partition.gathered(params):`, parts.partition.gather(params), or attach a "
            f"FetchCoordinator (for weights: parts.partition.full_state_dict)")


_COPY_ADVICE = (". For an average of the weights (torch.optim.swa_utils.AveragedModel: EMA, SWA), average an "
                "unsharded model: build the same class outside partitioned(), load "
                "parts.partition.full_state_dict(model, rank0_only=False) into it, wrap that in AveragedModel, "
                "and update it with the full weights: `with parts.partition.gathered(list(model.parameters())): "
                "ema.update_parameters(model)`")


def _first_released(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The first not-AVAILABLE sharded parameter among the arguments (lists one level deep)."""
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if type(t) is ReleasedParameter and _ATTR in t.__dict__ \
                    and t.__dict__[_ATTR].status is not ParamStatus.AVAILABLE:
                return t
    return None


_FULL_QUERIES = frozenset({"shape", "ndim", "size", "dim", "ndimension", "numel", "nelement", "stride",
                           "__len__", "nbytes"})


def _query_name(func: Any) -> Optional[str]:
    """``shape``, ``size``...: the name if ``func`` asks for the parameter's shape, else None."""
    attr = _attr_name(func)
    if attr is not None:
        return attr if func.__name__ == "__get__" and attr in _FULL_QUERIES else None
    name = getattr(func, "__name__", "")
    return name if name in _FULL_QUERIES else None


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _full_query(name: str, m: Any, p: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    """The answer of the full (gathered) parameter ``p`` to a shape query."""
    if name in ("shape", "ndim", "dim", "ndimension"):
        return m.shape if name == "shape" else len(m.shape)
    if name in ("numel", "nelement", "nbytes"):
        return m.numel * p.element_size() if name == "nbytes" else m.numel
    if name == "__len__":
        if not m.shape:
            raise TypeError("len() of a 0-d tensor")
        return m.shape[0]
    dim = args[0] if args else kwargs.get("dim")
    values = m.shape if name == "size" else torch.Size(_contiguous_strides(m.shape))
    if dim is None:
        return values if name == "size" else tuple(values)
    if not -max(len(values), 1) <= dim < max(len(values), 1):
        raise IndexError(f"Dimension out of range (expected to be in range of "
                         f"[{-len(values)}, {len(values) - 1}], but got {dim})")
    return values[dim] if values else 1


def _released_owner(args: tuple) -> Optional[Any]:
    """The record of ``args[0]`` if it is a sharded parameter that is not AVAILABLE."""
    t = args[0] if args else None
    m = t.__dict__.get(_ATTR) if type(t) is ReleasedParameter else None
    return m if m is not None and m.status is not ParamStatus.AVAILABLE else None


class ReleasedParameter(ShardedParameter):
    """The class of a sharded parameter while its full tensor is not in ``p.data``: ops raise;
    shape queries (``shape``, ``size()``, ``ndim``, ``dim()``, ``numel()``, ``stride()``,
    ``len()``, ``nbytes``) answer as the full parameter does."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        query = _query_name(func)
        if query is not None:
            m = _released_owner(args)
            if m is not None:
                return _full_query(query, m, args[0], args[1:], kwargs)
        if _reads_data(func):
            p = _first_released(args, kwargs)
            if p is not None:
                raise RuntimeError(_released_message(p, f"torch op `{_op_name(func)}`", by_op=True))
        out = default_torch_function(func, types, args, kwargs)
        if _attr_name(func) == "data" and func.__name__ == "__get__" and not in_internal():
            p = _first_released(args, kwargs)
            if p is not None:  # user code: a write through the empty .data would go nowhere
                out = out.as_subclass(ReleasedData)
                out.__dict__["_parts_owner"] = p
        return out

    def __repr__(self) -> str:
        m = self.__dict__.get(_ATTR)
        what = f"{m.describe()}, {m.status.value}, sharded over {m.world_size}" if m else "no record"
        return f"ReleasedParameter({what})"

    def __deepcopy__(self, memo: dict) -> Any:
        raise RuntimeError(_released_message(self, "copy.deepcopy") + _COPY_ADVICE)

    def __reduce_ex__(self, proto: Any) -> Any:
        raise RuntimeError(_released_message(self, "pickling"))


class ReleasedData(torch.Tensor):
    """``p.data`` of a released parameter in user code: empty, and any op on its data raises
    (``p.data.zero_()`` would otherwise silently change nothing). Shape queries still work and
    say what it is: empty (the parameter itself answers with its full shape)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _reads_data(func):
            for a in (*args, *kwargs.values()):
                owner = a.__dict__.get("_parts_owner") if type(a) is ReleasedData else None
                if owner is not None:
                    raise RuntimeError(_data_message(owner, _op_name(func)))
        return default_torch_function(func, types, args, kwargs)


def _data_message(p: torch.Tensor, op: str) -> str:
    m = meta(p)
    return (f"parts.partition: {m.describe()} is sharded over {m.world_size} rank(s) and not "
            f"gathered, so its `.data` is empty: `{op}` on it would silently change nothing. "
            f"To write the weight: `with parts.partition.gathered([p], modifier_rank=0): "
            f"p.data.{op.rpartition('.')[2]}(...)` (rank 0's values are re-sharded on exit) "
            f"or parts.partition.load_full_state_dict")
