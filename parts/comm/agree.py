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
  with those of the ranks it names before the build's first collective (through the default
  store: ranks outside the build take no part).
- ``exchange_in_rounds(mine, scopes, rank_of, own, what)``: items gathered over several groups in
  turn, failures raised on every rank (``attach``'s agreement).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, TypeVar

from parts.comm.failure import Failure as Failure
from parts.comm.failure import RankDisagreement as RankDisagreement
from parts.comm.failure import attempt, describe, failures_in
from parts.comm.board import Meeting, runs, unrun
from parts.comm.group import (GroupArg, GroupInfo, ProcessGroup, global_rank, group_info, hybrid_groups,
                              is_distributed, is_member)
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
    """``hybrid_groups(...)``: the (shard group, replica group), checked against the layouts of the
    ranks it names (its shard and replica groups) and, one hop on, of the ranks they name, through
    the default store (``board.py``): ranks outside both groups take no part, so a rank that builds
    nothing (or builds over other groups) blocks no one. A rank whose groups are refused, or whose
    shard or replica group its members see otherwise (a mesh of another shape, a group left out,
    replicas at other places of their shard groups), raises on every rank of the groups it named
    and of theirs, naming the ranks: before the build's first collective. A rank whose layout names
    ranks that build otherwise raises a ``TimeoutError`` naming them after the store's timeout."""
    layout, own = attempt(lambda: hybrid_groups(group, replicate_group, mesh, what), global_rank())
    if not is_distributed():
        if own is not None:
            raise own
        return layout
    named, mine = _entry(layout, own, group, replicate_group, mesh)
    meeting = Meeting(mine, named, what, _describe)
    error = own if own is not None else _verdict(meeting.items, what)
    theirs = meeting.verdicts(None if error is None else _posted(error, layout if own is not None else None, what))
    if error is not None:
        raise error
    if theirs:
        kind, message = theirs[min(theirs)]
        raise (ValueError if kind == "ValueError" else RankDisagreement)(message)
    return layout


def _entry(layout: object, own: Optional[BaseException], group: GroupArg, replicate_group: GroupArg,
           mesh: object) -> tuple[set[int], object]:
    """The global ranks a build names and its entry: (rank, shard runs, replica runs), or its ``Failure``."""
    if own is not None:
        return _asked(group, replicate_group, mesh), layout
    shard, replicas = _ranks(layout)
    return {*shard, *(replicas or ())}, (global_rank(), runs(shard), runs(replicas) if replicas else None)


def _posted(error: BaseException, failure: Optional[Failure], what: str) -> tuple[str, str]:
    """What the ranks met raise for this rank's ``error``: its layout error itself, or a
    ``RankDisagreement`` naming this rank's ``failure``."""
    if failure is not None:
        return "RankDisagreement", _failed({failure.rank: failure}, what)
    return type(error).__name__, str(error)


def _verdict(items: dict, what: str) -> Optional[BaseException]:
    """The error of a layout check over ``items`` (global rank -> layout entry or ``Failure``), if any."""
    failures = {f.rank: f for f in items.values() if isinstance(f, Failure)}
    if failures:
        return RankDisagreement(_failed(failures, what))
    try:
        check_layouts({r: (unrun(shard), unrun(replicas) if replicas else None)
                       for r, shard, replicas in items.values()}, what)
    except ValueError as err:
        return err
    return None


def _failed(failures: Mapping[int, Failure], what: str) -> str:
    return f"{what} failed on other ranks, so no rank went on (global ranks) {describe(failures)}"


def _describe(item: object) -> str:
    """A layout entry as the error messages show it."""
    if isinstance(item, Failure):
        return item.error
    _, shard, replicas = item
    return _layout((unrun(shard), unrun(replicas) if replicas else None))


def _asked(group: GroupArg, replicate_group: GroupArg, mesh: object) -> set[int]:
    """The global ranks of the groups a refused layout asked for, where this rank can tell: the
    world for the default group, a group's ranks where this rank is in it, every rank of a mesh."""
    if mesh is not None:
        ranks = getattr(mesh, "mesh", None)
        return set(ranks.flatten().tolist()) if hasattr(ranks, "flatten") else set()
    asked = set(group_info(None).global_ranks()) if group is None else set()
    for g in (group, replicate_group):
        if isinstance(g, ProcessGroup) and is_member(g):
            asked |= set(group_info(g).global_ranks())
    return asked


def exchange_in_rounds(mine: object, scopes: list[GroupInfo], rank_of: Callable[[object], int],
                       own: Optional[BaseException], what: str) -> list:
    """Every rank's item (``mine``: this rank's, or its ``Failure``), all-gathered over each of
    ``scopes`` in turn (earlier rounds' items travel on, so two rounds over a grid's rows then
    columns reach every rank); ``rank_of`` gives an item's global rank. Raises ``own`` (this
    rank's exception) here, ``RankDisagreement`` naming the failed ranks elsewhere."""
    seen = [mine]
    for scope in scopes:
        every = all_gather_objects(seen, scope.group)
        seen = list({x.rank if isinstance(x, Failure) else rank_of(x): x for held in every for x in held}.values())
    failures = {f.rank: f for f in seen if isinstance(f, Failure)}
    if own is not None:
        raise own
    if failures:
        raise RankDisagreement(_failed(failures, what))
    return seen


def _ranks(layout: Layout) -> tuple:
    info, replica = layout
    return tuple(info.global_ranks()), tuple(replica.global_ranks()) if replica is not None else None


def check_layouts(every: dict, what: str) -> None:
    """Raise a ValueError naming two ranks (``every``: global rank -> (shard, replica ranks)) if a
    member of a rank's shard group sees that group or its replica count otherwise, or a member of
    its replica group sees that group otherwise or sits at another place of a shard group."""
    for rank, (shard, replicas) in sorted(every.items()):
        for other in [*shard, *(replicas or ())]:
            if other not in every:
                continue
            o_shard, o_replicas = every[other]
            if other in shard:
                same = o_shard == shard and len(o_replicas or ()) == len(replicas or ())
            else:
                same = (o_replicas == replicas and len(o_shard) == len(shard)
                        and o_shard.index(other) == shard.index(rank))
            if not same:
                raise ValueError(f"{what}: the ranks disagree on the layout (group=/replicate_group= or "
                                 f"mesh=): global rank {rank} {_layout(every[rank])}, global rank "
                                 f"{other} {_layout(every[other])}; a (replicate, shard) layout must be "
                                 f"the same on every rank")


def _layout(ranks: tuple) -> str:
    shard, replicas = ranks
    return f"shards over global ranks {list(shard)}, replicated over {list(replicas) if replicas else 'none'}"
