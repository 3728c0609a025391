"""A model as the planner sees it: its module tree and parameter sizes, nothing else.

``ModelShape`` is plain data (no torch): module names in ``named_modules()`` order, each
module's parent, the ids and local names of its own parameters (a tied parameter has one id
in every module that registers it), each id's element count, and which ids train.
``shape_of(model)`` reads it off any ``nn.Module``: real, on the meta device, or sharded by
``parts.partition``. A forward that reads another module's parameter (a head computed as
``F.linear(x, wte.weight)``) is invisible in the tree: declare it with ``with_reads``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from parts.partition import is_partitioned, meta

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclass(frozen=True)
class ModelShape:
    """Module tree and parameter sizes: what fetch units, traces and bytes follow from."""

    names: tuple
    parents: tuple  # parents[i]: index of module i's parent (-1 for the root, index 0)
    own: tuple  # own[i]: ids of module i's own parameters, registration order
    local: tuple  # local[i]: the names of those parameters in module i
    sizes: dict  # id -> elements
    trainable: frozenset
    coverable: tuple  # coverable[i]: module i may be a unit over its subtree (not root, not a container)
    reads: tuple = ()  # (module index, id): a module's forward reads a parameter of another module

    @property
    def params(self) -> int:
        """Elements of the model (each tied parameter once)."""
        return sum(self.sizes.values())

    def largest_module(self) -> int:
        """Most elements owned directly by one module (DeepSpeed's "largest layer")."""
        return max((sum(self.sizes[pid] for pid in ids) for ids in self.own), default=0)

    def with_reads(self, reads: dict) -> "ModelShape":
        """This shape where module ``m`` also reads each parameter in ``reads[m]`` (qualified
        names), e.g. ``{"": ["wte.weight"]}`` for a root computing a tied head itself."""
        index = {name: i for i, name in enumerate(self.names)}
        pairs = []
        for module, params in reads.items():
            for qualified in params:
                owner, _, leaf = qualified.rpartition(".")
                k = index[owner]
                pairs.append((index[module], self.own[k][self.local[k].index(leaf)]))
        return replace(self, reads=self.reads + tuple(pairs))


def _ids(model: nn.Module) -> dict[int, int]:
    """A stable id per parameter: the sharded record's id, else first-registration order."""
    ids: dict[int, int] = {}
    for p in model.parameters():
        if id(p) not in ids:
            ids[id(p)] = meta(p).id if is_partitioned(p) else len(ids)
    return ids


def _numel(p: nn.Parameter) -> int:
    return meta(p).numel if is_partitioned(p) else p.numel()


def _parents(named: list) -> list[int]:
    """Each module's parent index (the first module listing it as a child), as the coordinator's table."""
    index = {id(m): i for i, (_, m) in enumerate(named)}
    parents = [-1] * len(named)
    for i, (_, sub) in enumerate(named):
        for child in sub.children():
            j = index.get(id(child), 0)
            if j > i and parents[j] < 0:
                parents[j] = i
    return parents


def shape_of(model: nn.Module) -> ModelShape:
    """The ``ModelShape`` of ``model`` (the same tree the coordinator's table walks)."""
    named = list(model.named_modules())
    ids = _ids(model)
    own, local, sizes, trainable = [], [], {}, set()
    for _, sub in named:
        mine, names = [], []
        for name, p in sub.named_parameters(recurse=False):
            pid = ids[id(p)]
            if pid not in mine:
                mine.append(pid)
                names.append(name)
            sizes[pid] = _numel(p)
            if p.requires_grad:
                trainable.add(pid)
        own.append(tuple(mine))
        local.append(tuple(names))
    coverable = tuple(i > 0 and not isinstance(sub, _CONTAINERS) for i, (_, sub) in enumerate(named))
    return ModelShape(tuple(n for n, _ in named), tuple(_parents(named)), tuple(own), tuple(local),
                      sizes, frozenset(trainable), coverable)
