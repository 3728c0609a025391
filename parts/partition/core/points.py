"""Collectives outside a coordinator's steps, announced to the debug check that counts them.

``FetchCoordinator(debug=True)`` makes the ranks agree on every collective of a step. A
rank that runs one batch more than the others (or skips one and goes on to the optimizer
step) meets the others in a collective *outside* a step: a state dict, an optimizer step,
``detach``. Those announce themselves here; a debug coordinator that owns the parameters
registered a checker on their records, which agrees with the other ranks on what each
rank is doing and how many steps it ran, and raises ``RankDivergence`` on every rank if
they differ. Without a debug coordinator, announcing costs a dict lookup per parameter.
"""

from __future__ import annotations

from typing import Any, Iterable

from parts.partition.core.param import is_partitioned, meta


def register(records: Iterable[Any], checker: Any) -> None:
    """Let ``checker`` (a ``weakref.WeakMethod`` taking the announced name) check these params."""
    for m in records:
        m.checker = checker


def unregister(records: Iterable[Any], checker: Any) -> None:
    """Undo ``register`` for the records ``checker`` still holds."""
    for m in records:
        if m.checker is checker:
            m.checker = None


def announce(params: Iterable[Any], what: str) -> None:
    """Before a collective outside a step over ``params``: run each registered checker once."""
    seen = []
    for p in params:
        checker = meta(p).checker if is_partitioned(p) else None
        if checker is None or any(checker is s for s in seen):
            continue
        seen.append(checker)
        fn = checker()
        if fn is not None:
            fn(what)
