"""The record of a sharded parameter (``ParamMeta``) and how to find it (``meta``).

A sharded parameter stays the same ``nn.Parameter`` object; its record lives in the
attribute ``_parts_meta``. While released, ``p.data`` is an empty tensor (numel 0, the
shard dtype, the compute device, no storage); the parameter itself answers ``shape``,
``size()``, ``ndim``, ``dim()``, ``numel()``, ``stride()``, ``len()`` and ``nbytes`` with the full
(gathered) values from the record at all times, as FSDP2's DTensor parameters do, so code
that groups parameters by shape sees what it sees on the unsharded model.
All fresh tensors of this package come from ``alloc`` so that a test can poison them.

Guard. A released parameter must never silently take part in math (``p + 1`` on a
numel-0 tensor is an empty tensor, not an error). So whenever ``status`` is not AVAILABLE
the parameter's class is ``ReleasedParameter`` (an ``nn.Parameter`` subclass whose
``__torch_function__`` raises, naming the parameter and its module, for every op that
reads data); setting ``status`` to AVAILABLE gives it back its own class. Gathered
parameters therefore pay nothing per op (the class switch costs well under a
microsecond per gather/release). Metadata stays usable while released: attributes
(``p.data`` get/set, ``.grad``, ``.dtype``, ``.requires_grad``...) except views
(``.T``, ``.mT``, ``.real``...), shape queries (the full values), storage and pointer
queries (memory accounting), hooks, ``requires_grad_``, ``hash``; ``copy.deepcopy`` and
pickling raise instead of copying an empty tensor. ``p.data`` is the plain (empty) tensor
in library code (``internal``); in user code it is a ``ReleasedData`` whose data ops raise,
since a write through it (``p.data.zero_()``) would silently go nowhere.

Freed storage. ``release(..., free_storage=True)`` (what the coordinator does) also
resizes the storage of the full tensor to 0 bytes and keeps the tensor on the record
(``shrunk``); the next ``gather`` resizes that same storage back and fills it. Views of
the full tensor that autograd saved in forward (``weight.t()`` of ``F.linear``) therefore
hold no memory while the parameter is released, and see the re-gathered values in
backward; used before that, they raise (a storage of size 0), never read stale data.
Given a ``StoragePool`` (the coordinator's), the freed memory goes to the pool and the
next gather of a parameter of that byte size gets it back, instead of the allocator.

Freshness. ``full_version`` is the shard's version (``shard_version``) when the full
tensor was gathered; ``is_stale`` says the shard changed since (an optimizer stepped it
while the parameter stayed gathered), and ``gather`` fetches such a parameter again.
Code that writes the shard *and* the full tensor consistently calls ``stamp``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from torch import nn

from parts.comm import GroupArg, GroupInfo
from parts.partition.core import disk
from parts.base.layout import ShardLayout
from parts.partition.core.grad_guard import ATTR as _ATTR
from parts.partition.core.grad_guard import ShardedParameter, as_grad_shard, follow_requires_grad
from parts.partition.core.grad_guard import in_internal as in_internal  # used with the records
from parts.partition.core.grad_guard import internal as internal  # the records' guard, used with them
from parts.partition.core.released import ParamStatus as ParamStatus
from parts.partition.core.released import ReleasedParameter
from parts.partition.core.steps import install as install_step_hooks
from parts.partition.core.steps import watch as watch_steps


@dataclass(eq=False)
class ParamMeta:
    """Global shape, layout, local shard, grad shard and status of one sharded parameter."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    layout: ShardLayout
    shard: torch.Tensor = field(repr=False)
    info: GroupInfo
    id: int
    device: torch.device
    _status: ParamStatus = ParamStatus.NOT_AVAILABLE
    module_name: str = ""
    module_type: str = ""
    handle: Optional[Any] = None
    init_dtype: Optional[torch.dtype] = None  # dtype the parameter was created in (before ``dtype=``)
    _grad: Optional[torch.Tensor] = field(default=None, repr=False)
    full_version: Any = field(default=None, repr=False)  # shard_version() of the gathered full tensor
    _owner: Any = field(default=None, repr=False)  # weakref to the parameter (set by attach_meta)
    _cls: Optional[type] = field(default=None, repr=False)  # its class while AVAILABLE (None: unguarded)
    full_ptr: int = 0  # data_ptr of the storage ``gather`` filled (0: none)
    compute_dtype: Optional[torch.dtype] = None  # a MixedPrecision policy's gather dtype (None: ``dtype``)
    full_dtype: Optional[torch.dtype] = None  # dtype of the full tensor gathered last
    shrunk: Optional[torch.Tensor] = field(default=None, repr=False)  # full tensor whose storage
    # ``release(free_storage=True)`` resized to 0; the next gather refills that very storage
    steps: int = 0  # optimizer steps on the shard (core/steps.py: fused kernels bump no version)
    checker: Any = field(default=None, repr=False)  # weak method a debug coordinator registered
    # (core/points.py): collectives outside its steps over this param are agreed across ranks
    in_flat: bool = False  # the full tensor is a view of a buffer shared with other params (the
    # coordinator's flat persistent buffer): never freed or refilled alone
    replica: Optional[GroupInfo] = None  # a hybrid layout's replica group: the same shard on each
    # member, its grad shard averaged across them (core/replicas.py)
    replica_pending: bool = False  # the grad shard holds this replica's part only, not yet averaged
    compression: Any = field(default=None, repr=False)  # an attached Compression's state (core/compression.py)
    # truthy: the full tensor holds dequantized codes (a compressed gather), not the masters; the
    # gathered codes themselves (a Quantized of every rank's row) where a secondary store reuses them
    full_codes: Any = False
    attached: bool = False  # a FetchCoordinator's hooks fetch it (its released error names
    # register_external_parameter, the way to fetch it for another module)
    exact: Any = field(default=None, repr=False)  # reproducible mode: the fixed-point sums of its
    # grad (core/exact.py); None: grads are summed in floating point

    @property
    def status(self) -> ParamStatus:
        """AVAILABLE, NOT_AVAILABLE or INFLIGHT; setting it also switches the parameter's guard."""
        return self._status

    @status.setter
    def status(self, value: ParamStatus) -> None:
        self._status = value
        p = self._owner() if self._owner is not None else None
        if p is not None and self._cls is not None:
            target = self._cls if value is ParamStatus.AVAILABLE else ReleasedParameter
            if type(p) is not target:
                p.__class__ = target

    @property
    def numel(self) -> int:
        """Elements of the full (global) parameter."""
        return self.layout.numel

    @property
    def group(self) -> GroupArg:
        """The process group (None where torch.distributed is not initialised)."""
        return self.info.group

    @property
    def rank(self) -> int:
        """This process's rank in ``group``."""
        return self.info.rank

    @property
    def world_size(self) -> int:
        """Ranks the parameter is sharded over."""
        return self.info.world_size

    @property
    def grad_shard(self) -> Optional[torch.Tensor]:
        """This rank's gradient shard (1-D, ``shard_numel``); it is ``shard.grad`` when dtypes match."""
        return self.shard.grad if self.shard.grad is not None else self._grad

    @grad_shard.setter
    def grad_shard(self, value: Optional[torch.Tensor]) -> None:
        self._grad, self.shard.grad = None, None
        if value is None:
            return
        value = as_grad_shard(value)
        if value.dtype == self.shard.dtype and value.device == self.shard.device:
            self.shard.grad = value
        else:
            self._grad = value

    def describe(self) -> str:
        """``'name' (shape) of module 'module_name' (Type)`` for error messages."""
        where = f" of module '{self.module_name}' ({self.module_type})" if self.module_type else ""
        return f"parameter '{self.name}' {tuple(self.shape)}{where}"


def is_partitioned(p: Any) -> bool:
    """True if ``p`` is a parameter sharded by ``parts.partition``."""
    return isinstance(p, torch.Tensor) and _ATTR in getattr(p, "__dict__", {})


def meta(p: torch.Tensor) -> ParamMeta:
    """The ``ParamMeta`` of a sharded parameter; TypeError naming it otherwise."""
    record = getattr(p, "__dict__", {}).get(_ATTR)
    if record is None:
        shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
        raise TypeError(f"parts.partition: tensor {shape} is not a partitioned parameter; shard its "
                        f"module with partition_module(module) or build it inside partitioned()")
    return record


def attach_meta(p: nn.Parameter, record: ParamMeta) -> None:
    """Store ``record`` on ``p`` (internal) and guard ``p`` while it is not AVAILABLE."""
    p.__dict__[_ATTR] = record
    record._owner = weakref.ref(p)
    follow_requires_grad(record.shard, p.requires_grad)
    install_step_hooks()  # an optimizer over the parameter itself is refused at its first step
    own = ShardedParameter if type(p) in (nn.Parameter, ReleasedParameter) else type(p)
    try:  # a tensor subclass with another memory layout cannot switch class: left unguarded
        p.__class__ = ReleasedParameter
        p.__class__ = own
    except TypeError:
        return
    record._cls = own
    record.status = record.status


def shard_version(record: ParamMeta) -> tuple:
    """Identity, version counter, storage and optimizer steps of the shard: changes when anything
    writes it (a fused optimizer's step too, though it bumps no version counter)."""
    shard = record.shard
    watch_steps(shard, record)
    parked = disk.parked_version(shard)
    if parked is not None:  # a shard on disk: its storage comes and goes, its saves are counted
        return id(shard), parked, record.steps
    try:
        return id(shard), shard._version, shard.data_ptr(), record.steps
    except RuntimeError:  # an inference tensor has no version counter: never assume it is current
        return (object(),)


def memory_versions(records: list[ParamMeta]) -> list[tuple]:
    """``shard_version`` of each record in one pass, for shards in memory (not on disk) that
    ``watch_shards`` linked already: what the coordinator's flat buffer compares each step."""
    return [(id(m.shard), m.shard._version, m.shard.data_ptr(), m.steps) for m in records]


def watch_shards(records: list[ParamMeta]) -> None:
    """Link each record's shard to it (optimizer steps on it count in ``record.steps``)."""
    for m in records:
        watch_steps(m.shard, m)


def stamp(record: ParamMeta) -> None:
    """Record that the full tensor now matches the shard (after a gather or a consistent write)."""
    record.full_version = shard_version(record)


def wanted_dtype(record: ParamMeta, compute: bool) -> torch.dtype:
    """The dtype a gather makes the full tensor in: the policy's compute dtype if ``compute``, else the shard's."""
    return (record.compute_dtype or record.dtype) if compute else record.dtype


def is_stale(record: ParamMeta) -> bool:
    """True if the parameter is AVAILABLE but its shard changed since its full tensor was gathered."""
    return record.status is ParamStatus.AVAILABLE and record.full_version != shard_version(record)


def _empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


allocator = _empty
"""The function behind ``alloc``; a test may replace it (e.g. to poison fresh memory)."""


def alloc(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fresh uninitialised 1-D tensor: every buffer and full tensor of this package comes from here."""
    return allocator(numel, dtype, device)


def empty_like_released(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The numel-0 tensor a released parameter holds in ``p.data``."""
    return torch.empty(0, dtype=dtype, device=device)


def unique_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` without duplicates (by identity), order kept; accepts a single tensor."""
    if isinstance(params, torch.Tensor):
        params = [params]
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def metas_sorted(params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, ParamMeta]]:
    """``(p, meta(p))`` pairs of unique params sorted by the rank-consistent id."""
    pairs = [(p, meta(p)) for p in unique_params(params)]
    return sorted(pairs, key=lambda pm: pm[1].id)


def common_info(pairs: list[tuple[torch.Tensor, ParamMeta]], group: GroupArg, what: str) -> Optional[GroupInfo]:
    """The one group of ``pairs`` (checked against ``group`` if given); ValueError naming mismatches."""
    if not pairs:
        return None
    first = pairs[0][1]
    for _, m in pairs:
        if m.info.group is not first.info.group:
            raise ValueError(f"{what}: parameters of different process groups in one call: "
                             f"{first.describe()} and {m.describe()}; call once per group")
    if group is not None and group is not first.info.group:
        raise ValueError(f"{what}: {first.describe()} is sharded over another process group "
                         f"than the group passed")
    return first.info
