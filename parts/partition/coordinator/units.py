"""Fetch units: which submodule's hooks fetch which parameters. Pure arithmetic, no torch.

A fetch unit is a submodule whose whole subtree's parameters are gathered together before
its forward (and backward) and released together after: FSDP2's unit is the ``fully_shard``
module, here it is chosen by size. Walking the module tree from the root, a module whose
subtree holds at most ``limit`` elements becomes a unit over that subtree (not the root,
whose forward is the whole step, nor a container that is never called); a larger one is
a unit over its own parameters only and its children are looked at in turn. Modules inside
a unit (not its root) are ``inner``: their parameters come with the unit, so they need no
fetch of their own while the unit runs. ``limit=0`` gives today's leaf units (every module
fetches its own parameters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class FetchUnits:
    """``unit[i]``: index of the unit root whose fetch brings module ``i``'s parameters
    (``i`` itself for a unit root); ``members[r]``: parameter ids unit root ``r`` fetches
    (its own first, then its subtree's in module order, no duplicates)."""

    unit: tuple
    members: dict

    def is_root(self, index: int) -> bool:
        """True if module ``index`` is a unit root (its hooks fetch the unit)."""
        return self.unit[index] == index


def _subtree_ids(index: int, children: Sequence[Sequence[int]], own: Sequence[Sequence[int]]) -> list[int]:
    """Parameter ids of module ``index`` and everything below it, own first, no duplicates."""
    out, stack = [], [index]
    while stack:
        i = stack.pop()
        out.extend(own[i])
        stack.extend(reversed(children[i]))
    return list(dict.fromkeys(out))


def choose_units(parents: Sequence[int], own: Sequence[Sequence[int]], sizes: dict, limit: int,
                 coverable: Sequence[bool], hosts: Optional[dict] = None) -> FetchUnits:
    """Fetch units of a module tree: ``parents[i]`` is module ``i``'s parent index (-1 for the
    root, index 0; parents come before children), ``own[i]`` the ids of its own parameters,
    ``sizes`` each id's element count; only a ``coverable`` module can be a unit over its
    subtree (the coordinator passes False for the root, whose forward is the whole step, and
    for containers such as ``nn.ModuleList``, which are never called). ``hosts`` maps a module
    to an ancestor whose unit fetches its whole subtree, whatever the sizes (a module that only
    some ranks run: it then issues no gather of its own)."""
    hosts = hosts or {}
    children: list[list[int]] = [[] for _ in parents]
    for i, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(i)
    unit = list(range(len(parents)))
    members: dict[int, list[int]] = {}
    covered = [False] * len(parents)
    for i, parent in enumerate(parents):
        if parent >= 0 and covered[parent]:
            unit[i], covered[i] = unit[parent], True
            continue
        if i in hosts:
            root = unit[hosts[i]]
            unit[i], covered[i] = root, True
            members[root] = list(dict.fromkeys(members[root] + _subtree_ids(i, children, own)))
            continue
        ids = _subtree_ids(i, children, own)
        if coverable[i] and limit > 0 and children[i] and ids and sum(sizes[pid] for pid in ids) <= limit:
            members[i], covered[i] = ids, True
        else:
            members[i] = list(dict.fromkeys(own[i]))
    return FetchUnits(tuple(unit), members)
