"""The parameter table of the coordinator: modules, which parameters each fetches, their
records, sizes and which are persistent. Built once at ``attach``; only external
parameters are added later."""

from __future__ import annotations

from typing import Iterable, Optional

from torch import nn

from parts.comm import GroupArg
from parts.partition.coordinator.plan import Knobs, select_persistent
from parts.partition.coordinator.units import choose_units
from parts.partition.core import disk
from parts.partition.core.param import ParamMeta, meta


class ParamTable:
    """The attached model's modules (by index, in ``named_modules`` order) and parameters (by stable id).

    ``sets[index]``: stable ids the module at ``index`` fetches (a fetch unit's root: its
    subtree's, see units.py; any other module: its own), then external ones;
    ``unit[index]``: the unit root whose fetch brings that module's own parameters;
    ``version`` changes whenever a set grows. ``records``/``sizes``: each parameter's
    ``ParamMeta`` and element count. ``persistent``: ids gathered once and kept gathered.
    ``any_parked``: some shards live on disk (``parts.partition.core.disk``).
    """

    def __init__(self, module: nn.Module, knobs: Knobs, conditional: frozenset = frozenset()) -> None:
        named = list(module.named_modules())
        self.modules: list[nn.Module] = [m for _, m in named]
        self.names: list[str] = [n for n, _ in named]
        self.index: dict[int, int] = {id(m): i for i, m in enumerate(self.modules)}
        self.sets: list[list[int]] = [[] for _ in named]
        self.params: dict[int, nn.Parameter] = {}
        for index, sub in enumerate(self.modules):
            for p in sub.parameters(recurse=False):
                pid = meta(p).id
                if pid not in self.sets[index]:
                    self.sets[index].append(pid)
                self.params[pid] = p
        self.records: dict[int, ParamMeta] = {pid: meta(p) for pid, p in self.params.items()}
        self.param_names: dict[int, str] = {}  # stable id -> its first name (a tied weight: the first)
        for name, p in module.named_parameters():
            self.param_names.setdefault(meta(p).id, name)
        self.sizes: dict[int, int] = {pid: m.numel for pid, m in self.records.items()}
        self.unit = self._choose_units(min(knobs.fetch_unit_size, knobs.max_live_parameters), conditional)
        self._pids = {id(p): pid for pid, p in self.params.items()}
        self.any_parked = any(disk.parked_version(m.shard) is not None for m in self.records.values())
        self.persistent = select_persistent(self.sizes, knobs.persistence_threshold,
                                            knobs.model_persistence_threshold)
        self.persistent_ids = sorted(self.persistent)
        self.version = 0

    def _choose_units(self, limit: int, conditional: frozenset) -> tuple[int, ...]:
        """Fetch units of at most ``limit`` elements (units.py): a unit root's set becomes its
        subtree's parameters; an inner module keeps its own set for calls outside its unit.
        A ``conditional`` module (an index) is fetched with the nearest module around it that is
        called and not conditional itself; its parameters' ids are ``self.conditional``.
        Returns each module's unit root."""
        parents = [-1] * len(self.modules)
        for i, sub in enumerate(self.modules):
            for child in sub.children():
                j = self.index.get(id(child), 0)
                if j > i and parents[j] < 0:
                    parents[j] = i
        containers = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
        coverable = [i > 0 and not isinstance(sub, containers) for i, sub in enumerate(self.modules)]
        inside = _below(parents, conditional)
        self.conditional = frozenset(pid for i in inside for pid in self.sets[i])
        units = choose_units(parents, self.sets, self.sizes, limit, coverable,
                             self._hosts(parents, coverable, conditional, inside))
        for root, ids in units.members.items():
            self.sets[root] = ids
        return units.unit

    def _hosts(self, parents: list[int], coverable: list[bool], conditional: frozenset, inside: set[int]) -> dict:
        """For each outermost ``conditional`` module, the nearest module above it that is called
        (no container) and not conditional: its unit fetches the conditional one's subtree."""
        hosts = {}
        for i in sorted(conditional):
            if parents[i] < 0:
                raise ValueError(f"attach: conditional names the attached {type(self.modules[i]).__name__} "
                                 f"itself, whose forward is the whole step; name the submodules ranks may skip")
            if parents[i] not in inside:
                host = parents[i]
                while host > 0 and (host in inside or not coverable[host]):
                    host = parents[host]
                hosts[i] = host
        return hosts

    def is_unit_root(self, index: int) -> bool:
        """True if the module at ``index`` fetches a unit (else an inner module of one)."""
        return self.unit[index] == index

    def pid(self, param: nn.Parameter) -> Optional[int]:
        """Stable id of ``param`` if it is a parameter of the attached model."""
        return self._pids.get(id(param))

    def add_external(self, index: int, pid: int) -> bool:
        """Let the module at ``index`` fetch ``pid`` too; True if that is new."""
        if pid in self.sets[index]:
            return False
        self.sets[index].append(pid)
        self.version += 1
        return True

    def select(self, ids: Iterable[int]) -> list[nn.Parameter]:
        """The parameters of ``ids``, in that order."""
        return [self.params[pid] for pid in ids]

    def group(self, explicit: GroupArg) -> GroupArg:
        """The process group the parameters are sharded over (``explicit`` if given)."""
        if explicit is not None:
            return explicit
        return next(iter(self.records.values())).group if self.records else None

    def persistent_elements(self) -> int:
        """Elements of all persistent parameters."""
        return sum(self.sizes[pid] for pid in self.persistent)


def _below(parents: list[int], roots: frozenset) -> set[int]:
    """The indices of ``roots`` and of every module below one of them (parents come first)."""
    inside: set[int] = set()
    for i, parent in enumerate(parents):
        if i in roots or parent in inside:
            inside.add(i)
    return inside
