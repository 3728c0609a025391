"""A placement audit: every tensor handed to a torch.distributed collective must live on the
communication device (NCCL refuses any other). Helpers for ``test_placement_audit`` (no tests here).

It runs in this process on torch's fake process group (collectives return at once, nothing
moves), with every collective entry ``parts`` reaches wrapped: the wrapper records each tensor
off the declared device and the place in ``parts`` that issued it, then runs the collective and
fills its outputs as if every rank held this rank's values (so object exchanges and checks
agree and a run goes on).

On a machine without an accelerator the communication device would be the parameters' own CPU,
and a tensor made on the CPU by mistake would pass unseen. So each scenario declares another:

- ``meta`` mode: the model is built on the meta device and ``meta`` is declared the
  communication device (``parts.comm.declared_comm_device``). A tensor ``parts`` makes on the
  CPU for a collective (a norm accumulator, a flag, a header) is then off it, as it would be off
  a GPU. The host reads a run makes of meta tensors (``.item()``, ``.tolist()``, a copy to the
  CPU) answer the values ``MetaValues`` keeps beside the meta tensors that have some (what
  parts makes from host values: pickled objects, headers, flags), else zeros.
- ``cpu`` mode, for what needs values (offload to a ``DiskStore``, DCP files, pickled objects):
  the model on the CPU, the CPU the communication device, and the steps run under
  ``torch.set_default_device("meta")``: a tensor made without an explicit device lands on meta
  and is off the communication device (or fails), so nothing may depend on the default device.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from parts._compat import TorchDispatchMode

import parts._compat as compat
from parts.comm import declared_comm_device, fake_world

aten = torch.ops.aten
ENTRIES = ("all_reduce", "broadcast", "all_gather", "isend", "irecv", "send", "recv", "all_to_all_single",
           "reduce_scatter", "all_gather_into_tensor", "reduce_scatter_tensor")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _site() -> str:
    """The innermost caller outside parts.comm, torch and this audit that led here."""
    frames = [f for f in traceback.extract_stack()[:-3]
              if "/torch/" not in f.filename and f.filename.split("/")[-1] != "placement_audit.py"]
    outside = [f for f in frames if "/parts/comm/" not in f.filename and "_compat.py" not in f.filename]
    pick = (outside or frames)[-1]
    return f"{pick.filename.split('/')[-1]}:{pick.lineno} ({pick.name})"


class Audit:
    """Records collectives whose tensors are not on ``device``, by (entry, site, devices)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.violations: Counter = Counter()
        self.calls: Counter = Counter()

    def _on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device.type and self.device.index in (None, t.device.index)

    def check(self, entry: str, tensors: list[torch.Tensor]) -> None:
        """Count ``entry`` and record the tensors of this call that are off the device."""
        self.calls[entry] += 1
        off = sorted({str(t.device) for t in tensors if not self._on_device(t)})
        if off:
            self.violations[(entry, _site(), ",".join(off))] += 1

    def take(self) -> Counter:
        """The violations recorded since the last ``take``."""
        out, self.violations = self.violations, Counter()
        return out


def _fill(entry: str, args: tuple, kwargs: dict) -> None:
    """Outputs as if every rank held this rank's values (the fake group leaves them as they are)."""
    if entry == "all_gather":
        outs, inp = args[0], args[1]
        for o in outs:
            o.copy_(inp)
    elif entry == "all_gather_into_tensor":
        out, inp = args[0], args[1]
        out.view(-1, inp.numel()).copy_(inp.reshape(1, -1).expand(out.numel() // max(inp.numel(), 1), -1))
    elif entry == "reduce_scatter_tensor":
        out, inp = args[0], args[1]
        out.copy_(inp.reshape(-1, out.numel())[dist.get_rank(kwargs.get("group"))])


@contextlib.contextmanager
def auditing(audit: Audit) -> Iterator[Audit]:
    """Every collective entry of ``torch.distributed`` (and parts' flat ones) checked by ``audit``."""
    saved = []

    def wrap(owner: Any, name: str, entry: str) -> None:
        real = getattr(owner, name)

        def audited(*args, **kwargs):
            audit.check(entry, _tensors(args) + _tensors(list(kwargs.values())))
            work = real(*args, **kwargs)
            if entry in ("all_gather", "all_gather_into_tensor", "reduce_scatter_tensor"):
                _fill(entry, args, kwargs)
            return work
        saved.append((owner, name, real))
        setattr(owner, name, audited)

    for name in ENTRIES:
        if hasattr(dist, name):
            wrap(dist, name, name)
    wrap(compat, "_ALL_GATHER", "all_gather_into_tensor")
    wrap(compat, "_REDUCE_SCATTER", "reduce_scatter_tensor")
    try:
        yield audit
    finally:
        for owner, name, real in reversed(saved):
            setattr(owner, name, real)


class MetaValues(TorchDispatchMode):
    """Meta tensors with values where they can have them: every op on meta tensors also runs on
    CPU copies of their values (a shadow per meta tensor, best effort: an op whose inputs have no
    shadow, or whose shadow run fails, leaves its outputs without one). Host reads of a meta tensor
    (``.item()``, ``.tolist()``, a copy to the CPU) answer its shadow, else zeros (counted).
    So bytes and flags ``parts`` makes itself (pickled objects, headers) keep their values on
    their way through a collective, while the model's meta parameters stay without any."""

    def __init__(self) -> None:
        super().__init__()
        self.shadows: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.zeros = 0

    def _shadow(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            found = self.shadows.get(t)
            if found is None:
                raise LookupError
            return found
        if isinstance(t, torch.device) and t.type == "meta":
            return torch.device("cpu")
        return t

    def _host_read(self, func: Any, args: tuple, kwargs: dict) -> Any:
        src = args[0] if func is not aten.copy_.default else args[1]
        value = self.shadows.get(src)
        if value is None:
            self.zeros += 1
            value = torch.zeros(src.shape, dtype=src.dtype)
        if func is aten._local_scalar_dense.default:
            return value.item()
        if func is aten.copy_.default:
            return args[0].copy_(value)
        return value.to(dtype=kwargs.get("dtype") or src.dtype, copy=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_host(func, args, kwargs):
            return self._host_read(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in _NO_SHADOW or func.namespace in ("c10d", "_c10d_functional"):
            return out
        try:
            shadow_out = func(*tree_map(self._shadow, args), **tree_map(self._shadow, kwargs))
        except Exception:  # noqa: BLE001 - no values for this op's outputs (best effort)
            return out
        for o, so in zip(tree_leaves(out), tree_leaves(shadow_out)):
            if isinstance(o, torch.Tensor) and o.device.type == "meta" and isinstance(so, torch.Tensor):
                self.shadows[o] = so
        return out


_NO_SHADOW = (aten.set_.source_Storage_storage_offset, aten.set_.source_Storage)


def _reads_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """True for ``.item()`` of a meta tensor, a copy of one to the CPU, or into a CPU tensor."""
    if not args or not isinstance(args[0], torch.Tensor):
        return False
    if func is aten._local_scalar_dense.default:
        return args[0].device.type == "meta"
    if func is aten._to_copy.default:
        return args[0].device.type == "meta" and torch.device(kwargs.get("device") or "meta").type == "cpu"
    return func is aten.copy_.default and args[0].device.type == "cpu" and args[1].device.type == "meta"


def run_scenario(audit: Audit, body: Callable[[], Any], mode: str) -> dict:
    """Run ``body`` under ``audit`` in ``mode`` ("meta" or "cpu", see the module docstring): its
    violations, the collectives it issued and the error it raised (None if none)."""
    error = None
    before = sum(audit.calls.values())
    values = MetaValues()
    with contextlib.ExitStack() as stack:
        stack.enter_context(declared_comm_device(audit.device))
        stack.enter_context(auditing(audit))
        if mode == "meta":
            stack.enter_context(values)
        try:
            body()
        except Exception as exc:  # noqa: BLE001 - reported with the violations, the test decides
            error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            error += " at " + " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}"
                                          for f in reversed(traceback.extract_tb(exc.__traceback__)[-4:]))
    return dict(violations=audit.take(), collectives=sum(audit.calls.values()) - before,
                error=error, zero_reads=values.zeros)


@contextlib.contextmanager
def fake_group(world_size: int) -> Iterator[None]:
    """This process as rank 0 of a fake ``world_size``-rank default group."""
    with fake_world(world_size):
        yield


@contextlib.contextmanager
def default_device(device: str) -> Iterator[None]:
    """``torch.set_default_device(device)`` for the block."""
    prior = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(prior)
