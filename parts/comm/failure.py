"""What a rank sends the others when its part of a collective step raised.

A ``Failure`` travels through pickle like any result, so a receiver recognises it by its
type (``isinstance``), never by identity: a sentinel compared with ``is`` after a pickle
round trip is a different object and every check would pass.
"""

from __future__ import annotations

import traceback as _traceback
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional


@dataclass(frozen=True)
class Failure:
    """One rank's failed step: its group rank, ``error`` (``"Type: message"``), ``traceback`` text."""

    rank: int
    error: str
    traceback: str

    @classmethod
    def of(cls, exc: BaseException, rank: int) -> "Failure":
        """The failure record of ``exc`` raised on group rank ``rank``."""
        text = "".join(_traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(rank, f"{type(exc).__name__}: {exc}", text)


class RankDisagreement(RuntimeError):
    """A check failed on other ranks of the group (this rank's own check passed)."""


def attempt(fn: Callable[[], Any], rank: int) -> tuple[Any, Optional[BaseException]]:
    """``(fn(), None)``, or ``(Failure, the exception)`` if ``fn`` raised."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
        return Failure.of(exc, rank), exc


def failures_in(values: list) -> dict[int, Failure]:
    """The ``Failure`` records among ``values`` (one per rank, in group-rank order), by rank."""
    return {rank: v for rank, v in enumerate(values) if isinstance(v, Failure)}


def describe(failures: Mapping[int, Failure], tracebacks: bool = False) -> str:
    """One line per distinct error naming its ranks (``rank 1``, ``ranks 0, 2``), each with
    its traceback once when ``tracebacks``."""
    by_error: dict[str, list[Failure]] = {}
    for rank in sorted(failures):
        by_error.setdefault(failures[rank].error, []).append(failures[rank])
    lines = []
    for error, group in by_error.items():
        ranks = ", ".join(str(f.rank) for f in group)
        lines.append(f"rank{'s' if len(group) > 1 else ''} {ranks}: {error}")
        if tracebacks:
            lines.append(group[0].traceback.rstrip())
    return "\n".join(lines)
