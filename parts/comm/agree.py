"""Checks that must pass on every rank of a group before any rank acts on them.

One rank raising while the others go on into a collective is itself a hang: a state dict
missing on one rank, a checkpoint file only some ranks could read. ``agree`` runs a check
on every rank, exchanges the verdicts (one object all-gather) and raises on every rank if
any rank failed, naming the ranks and their errors; nothing has changed on any rank then.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

from parts.comm.group import GroupInfo
from parts.comm.objects import all_gather_objects

__all__ = ["RankDisagreement", "agree"]

T = TypeVar("T")


class RankDisagreement(RuntimeError):
    """A check failed on other ranks of the group (this rank's own check passed)."""


def _describe(verdicts: list[Optional[str]], ranks: list[int]) -> str:
    return "; ".join(f"rank {r}: {v}" for r, v in zip(ranks, verdicts) if v is not None)


def agree(check: Callable[[], T], info: GroupInfo, what: str) -> T:
    """``check()``'s result if it passed on every rank of ``info``; otherwise raise everywhere.

    A rank whose own check raised re-raises its exception (type kept); the others raise
    ``RankDisagreement`` naming the failing ranks and their messages."""
    error: Optional[BaseException] = None
    result = None
    try:
        result = check()
    except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
        error = exc
    mine = None if error is None else f"{type(error).__name__}: {error}"
    verdicts = all_gather_objects(mine, info.group) if info.world_size > 1 else [mine]
    if error is not None:
        raise error
    if any(v is not None for v in verdicts):
        ranks = list(range(len(verdicts)))
        raise RankDisagreement(f"{what} failed on other ranks of the group, so no rank went on "
                               f"(group ranks) {_describe(verdicts, ranks)}")
    return result  # type: ignore[return-value]
