"""Checks and steps that must pass on every rank of a group before any rank acts on them.

One rank raising while the others go on into a collective is itself a hang: a state dict
missing on one rank, a checkpoint file only some ranks could read. Every such step runs its
local part on every rank, exchanges the outcome (a result, or a ``Failure`` record:
recognised by type after pickling, never by identity) and, if any rank failed, raises on
every rank, naming the failing ranks and their errors.

- ``agree(check, info, what)``: nothing is exchanged but the verdicts; the failing rank
  re-raises its own exception, the others raise ``RankDisagreement``.
- ``all_gather_agreed(fn, info, error)`` / ``broadcast_agreed(fn, src, info, error)``: the
  results themselves are exchanged; on a failure ``error(failures)`` is raised on every rank
  (chained to the local exception where there is one).
- ``agree_on_layout(group, replicate_group, mesh, what)``: a sharded build's (shard group, replica group), compared
  across the world before the build's first collective.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, TypeVar

from parts.comm.failure import Failure as Failure
from parts.comm.failure import RankDisagreement as RankDisagreement
from parts.comm.failure import attempt, describe, failures_in
from parts.comm.group import GroupArg, GroupInfo, global_rank, group_info, hybrid_groups, is_distributed, is_member
from parts.comm.objects import all_gather_objects, broadcast_object


T = TypeVar("T")
ErrorFor = Callable[[Mapping[int, Failure]], BaseException]


def _raise(failures: Mapping[int, Failure], own: Optional[BaseException], error: ErrorFor) -> None:
    """Raise ``error(failures)`` if there are failures (from ``own``, this rank's exception)."""
    if not failures:
        return
    raised = error(failures)
    if own is None or raised is own:
        raise raised
    raise raised from own


def agree(check: Callable[[], T], info: GroupInfo, what: str) -> T:
    """``check()``'s result if it passed on every rank of ``info``; otherwise raise everywhere.

    A rank whose own check raised re-raises its exception (type kept); the others raise
    ``RankDisagreement`` naming the failing ranks and their messages."""
    result, own = attempt(check, info.rank)
    verdict = result if own is not None else None
    verdicts = all_gather_objects(verdict, info.group) if info.world_size > 1 else [verdict]

    def error(failures: Mapping[int, Failure]) -> BaseException:
        if own is not None:
            return own
        return RankDisagreement(f"{what} failed on other ranks of the group, so no rank went on "
                                f"(group ranks) {describe(failures)}")
    _raise(failures_in(verdicts), own, error)
    return result


def all_gather_agreed(fn: Callable[[], T], info: GroupInfo, error: ErrorFor) -> list[T]:
    """Every rank's ``fn()``, in group-rank order, if it returned on every rank; otherwise
    ``error(failures)`` raised on every rank."""
    mine, own = attempt(fn, info.rank)
    every = all_gather_objects(mine, info.group) if info.world_size > 1 else [mine]
    _raise(failures_in(every), own, error)
    return every


def broadcast_agreed(fn: Callable[[], T], src: int, info: GroupInfo, error: ErrorFor) -> T:
    """``fn()`` run on group rank ``src`` only, on every rank; if it raised there,
    ``error(failures)`` raised on every rank."""
    mine, own = attempt(fn, info.rank) if info.rank == src else (None, None)
    result = broadcast_object(mine, src, info.group) if info.world_size > 1 else mine
    _raise({src: result} if isinstance(result, Failure) else {}, own, error)
    return result


Layout = tuple[GroupInfo, Optional[GroupInfo]]


def agree_on_layout(group: GroupArg, replicate_group: GroupArg, mesh: object, what: str) -> Layout:
    """``hybrid_groups(...)``: the (shard group, replica group), checked against every rank's
    when this rank's layout spans the world: one exchange of global ranks over the world. A
    rank whose groups are refused (when this rank is in them and they cover the world), or whose
    shard or replica group its members see otherwise (a mesh of another shape, a group left
    out), raises on every rank, naming the ranks: before the build's first collective, which
    such ranks would issue over different groups."""
    layout, own = attempt(lambda: hybrid_groups(group, replicate_group, mesh, what), global_rank())
    if not is_distributed():
        if own is not None:
            raise own
        return layout
    world = group_info(None).world_size
    if own is not None and not _asks_for_world(group, replicate_group, mesh, world):
        raise own  # the others may build nothing with this rank
    if own is None:
        info, replica = layout
        if info.world_size * (replica.world_size if replica is not None else 1) != world:
            return layout  # a layout on part of the ranks: the others may never build this model
    every = all_gather_objects(layout if own is not None else _ranks(layout), None)
    failures = failures_in(every)
    if own is not None:
        raise own
    if failures:
        raise RankDisagreement(f"{what} failed on other ranks, so no rank went on (global ranks) "
                               f"{describe(failures)}")
    _check_layouts(every, what)
    return layout


def _ranks(layout: Layout) -> tuple:
    info, replica = layout
    return tuple(info.global_ranks()), tuple(replica.global_ranks()) if replica is not None else None


def _asks_for_world(group: GroupArg, replicate_group: GroupArg, mesh: object, world: int) -> bool:
    """True if this rank is in every group asked for and they cover the world between them."""
    if mesh is not None:
        return getattr(mesh, "size", lambda: 0)() == world
    covered: set[int] = set()
    for g in (group, replicate_group):
        if g is not None and not is_member(g):
            return False
        covered |= set(range(world)) if g is None else set(group_info(g).global_ranks())
    return len(covered) == world


def _check_layouts(every: list, what: str) -> None:
    """Raise a ValueError naming two ranks if a member of some rank's shard or replica group
    sees that group otherwise, or replicas sit at other places of their shard groups."""
    for rank, (shard, replicas) in enumerate(every):
        for other in [*shard, *(replicas or ())]:
            o_shard, o_replicas = every[other]
            same = o_shard == shard if other in shard else o_replicas == replicas
            if same and other in (replicas or ()):
                same = len(o_shard) == len(shard) and o_shard.index(other) == shard.index(rank)
            if not same:
                raise ValueError(f"{what}: the ranks disagree on the layout (group=/replicate_group= or "
                                 f"mesh=): global rank {rank} {_layout(every[rank])}, global rank "
                                 f"{other} {_layout(every[other])}; a (replicate, shard) layout must be "
                                 f"the same on every rank")


def _layout(ranks: tuple) -> str:
    shard, replicas = ranks
    return f"shards over global ranks {list(shard)}, replicated over {list(replicas) if replicas else 'none'}"
