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
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, TypeVar

from parts.comm.failure import Failure as Failure
from parts.comm.failure import RankDisagreement as RankDisagreement
from parts.comm.failure import attempt, describe, failures_in
from parts.comm.group import GroupInfo
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
