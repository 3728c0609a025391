"""Ranks that run different modules in one step: agreed once, at the end of each backward.

Every gather and reduce-scatter of the coordinator is a collective, so every rank must issue the
same ones in the same order, while which modules a rank runs may differ (an MoE expert that got
no tokens there, ``heads[rank]``, a branch):

* a module whose parameters need no gather of their own (persistent ones, gathered for the whole
  step; those inside a fetch unit that every rank runs; those of ``attach(..., conditional=...)``
  modules, gathered with the module around them: table.py) differs only in its grads, which a
  rank that did not run it lacks. At the end of each backward the ranks agree on which parameters
  some rank holds a grad for (one all-reduce, MAX, of a flag per parameter); a rank lacking one of
  them takes a zero grad, so every rank reduce-scatters the same grads in the same order and the
  result is that of one process running the whole batch (DDP's ``find_unused_parameters``,
  FSDP2's ``set_reduce_scatter_unused_params``). A parameter no rank has a grad for keeps none.
* the same all-reduce carries a digest of the gathers and reduce-scatters this rank issued since
  the last agreement (``CollectiveLog``). A module gathered by a collective of its own on some
  ranks only pairs that gather with another module's on the other ranks (wrong values, or a
  collective of another size: a gloo abort, an NCCL hang). Where the collectives still met, the
  digests differ and every rank raises ``RankDivergence`` naming the first collective that
  differed, its modules and ranks; a no-grad step that gathered agrees the same way at its end.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from parts.comm import GroupArg, GroupInfo, all_gather_objects, group_info, max_everywhere
from parts.partition.coordinator.debug import RankDivergence
from parts.partition.coordinator.table import ParamTable
from parts.partition.core.grad_guard import raw_grad, set_full_grad
from parts.partition.core.param import wanted_dtype

GATHER, REDUCE = 0, 1
_WORDS = ("gather", "reduce-scatter")
_MASK = (1 << 62) - 1
KNOB_HINT = ("a module that only some ranks run, gathered by itself, needs attach(model, conditional=[...]) "
             "(docs/sharding.md, \"Ranks that run different modules\")")


class CollectiveLog:
    """The coordinator's gathers and reduce-scatters (parameter ids) since the last agreement."""

    def __init__(self) -> None:
        self.events: list[tuple[int, tuple]] = []
        self.digest = 0

    def note(self, kind: int, ids: Sequence[int]) -> None:
        """One collective of ``kind`` (GATHER, REDUCE) over the parameters ``ids``."""
        event = (kind, tuple(ids))
        self.events.append(event)
        self.digest = hash((self.digest, event)) & _MASK  # ints and tuples hash alike in every process

    def reset(self) -> None:
        """Forget what was noted (after an agreement, when a backward ends)."""
        self.events, self.digest = [], 0


class UnevenRanks:
    """The end-of-backward agreement of one coordinator over its shard group (module docstring)."""

    def __init__(self, table: ParamTable, group: GroupArg) -> None:
        self.table = table
        self.info: Optional[GroupInfo] = group_info(table.group(group)) if table.records else None
        self.replica = next((m.replica for m in table.records.values() if m.replica is not None), None)
        self.order = list(table.params)  # the flags' order: the same on every rank
        self.log = CollectiveLog()
        self.zero_filled = 0  # grads this rank took as zeros at the last agreement

    def after_backward(self, across: bool) -> None:
        """Agree on the digest and on which parameters some rank has a grad for; take zero grads for
        the ones this rank lacks. In a hybrid layout, unless this backward runs under ``no_sync``
        (``across`` False), across replicas too, grad shards awaiting their cross-replica mean
        counted as grads: every replica then reduces and averages the same ones."""
        scopes = [info for info in (self.info, self.replica if across else None)
                  if info is not None and info.world_size > 1]
        if not scopes:
            return self.log.reset()
        params = [self.table.params[pid] for pid in self.order]
        have = [raw_grad(p) is not None for p in params]
        mine = [int(here or (across and self.table.records[pid].replica_pending))
                for pid, here in zip(self.order, have)]
        agreed = self._agree(mine, scopes)
        lacking = [(pid, p) for pid, p, here, anyone in zip(self.order, params, have, agreed)
                   if anyone and not here and p.requires_grad]
        for pid, p in lacking:
            m = self.table.records[pid]
            set_full_grad(p, torch.zeros(m.shape, dtype=wanted_dtype(m, True), device=m.device))
        self.zero_filled = len(lacking)

    def after_forward(self) -> None:
        """A step without backward ends: if it gathered, agree on the digest."""
        if self.info is not None and self.info.world_size > 1 and self.log.events:
            self._agree([], [self.info])
        self.log.reset()

    def _agree(self, flags: list[int], scopes: list[GroupInfo]) -> list[int]:
        """``flags``' maximum over the ranks of ``scopes`` in turn, after checking that every rank's
        digest is the same."""
        digest = self.log.digest
        out = flags + [digest, -digest]
        for info in scopes:
            out = max_everywhere(out, info)
        if out[-2] != -out[-1]:
            self._raise(scopes)
        self.log.reset()
        return out[:-2]

    def _raise(self, scopes: list[GroupInfo]) -> None:
        """Every rank's log exchanged (over each scope); the first collective that differed, named."""
        found = [self._difference(all_gather_objects(self.log.events, info.group), info) for info in scopes]
        self.log.reset()
        what = next((f for f in found if f), "This rank's groups issued the same ones; another group's differed")
        raise RankDivergence(f"FetchCoordinator: the ranks issued different collectives in this step, so "
                             f"gathers and reduce-scatters of different modules met and their values are "
                             f"wrong. {what}. Every rank must run the modules gathered by collectives of "
                             f"their own; {KNOB_HINT}")

    def _difference(self, every: list[list], info: GroupInfo) -> str:
        """The first collective in which the logs ``every`` (group-rank order) differ, described."""
        k = next((k for k in range(max(map(len, every))) if len({tuple(e[k:k + 1]) for e in every}) > 1), None)
        if k is None:
            return ""
        by_event: dict[tuple, list[int]] = {}
        for r, events in enumerate(every):
            by_event.setdefault(tuple(events[k:k + 1]), []).append(info.global_rank(r))
        what = "; ".join(f"{self._describe(event)} on rank(s) {ranks}" for event, ranks in by_event.items())
        return f"Collective {k + 1} of the step was: {what}"

    def _describe(self, event: tuple) -> str:
        if not event:
            return "none (no more collectives)"
        (kind, ids), = event
        return f"a {_WORDS[kind]} of module(s) {self._modules(ids)}"

    def _modules(self, ids: tuple) -> list[str]:
        names = [self.table.param_names.get(pid, f"#{pid}") for pid in ids]
        return list(dict.fromkeys(name.rpartition(".")[0] or "<root>" for name in names))


def conditional_roots(module: nn.Module, conditional: Sequence) -> set[int]:
    """Indices (in ``named_modules`` order) of the modules of ``module`` matching ``conditional``
    (module instances, or classes matched by ``isinstance``); raises naming an instance that is not
    in ``module``."""
    modules = [m for _, m in module.named_modules()]
    types = tuple(c for c in conditional if isinstance(c, type))
    instances = [c for c in conditional if not isinstance(c, type)]
    for c in instances:
        if not isinstance(c, nn.Module):
            raise TypeError(f"attach: conditional takes modules or module classes, got {type(c).__name__}")
        if not any(c is m for m in modules):
            raise ValueError(f"attach: conditional module {type(c).__name__} is not a submodule of the "
                             f"attached {type(module).__name__}")
    ids = {id(c) for c in instances}
    return {i for i, m in enumerate(modules) if id(m) in ids or (types and isinstance(m, types))}
