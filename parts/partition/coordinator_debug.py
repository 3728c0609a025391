"""Debug mode of the fetch coordinator: check that every rank runs the same submodule sequence.

Every collective needs all ranks to call it in the same order; a rank that runs a submodule
the others skip hangs them all. With ``debug=True`` the coordinator exchanges a fingerprint
``(event number, kind, module index)`` before every fetch and at the end of every step, and
the trace digest at the end of every step, and raises on every rank with the first divergent
module's name instead of hanging in a mismatched collective. Costs one small all-gather per
event: a debugging aid, not for production runs.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from parts._compat import all_gather_flat

__all__ = ["RankDivergence", "exchange", "check_event", "check_digest", "check_refresh"]

_KINDS = {"F": 0, "B": 1, "end": 2}
_NAMES = {v: k for k, v in _KINDS.items()}


class RankDivergence(RuntimeError):
    """Ranks ran different submodule sequences (they would deadlock in a collective)."""


def exchange(values: Sequence[int], group: Any) -> list[list[int]]:
    """All-gather a short list of ints from every rank of ``group`` (rank order)."""
    if not dist.is_available() or not dist.is_initialized():
        return [list(values)]
    world = dist.get_world_size(group)
    mine = torch.tensor(list(values), dtype=torch.int64)
    out = torch.empty(world * mine.numel(), dtype=torch.int64)
    all_gather_flat(out, mine, group=group)
    return out.view(world, -1).tolist()


def _describe(row: list[int], names: Sequence[str]) -> str:
    kind = _NAMES.get(row[1], "?")
    if kind == "end":
        return "the end of its step"
    what = "forward" if kind == "F" else "backward"
    name = names[row[2]] if 0 <= row[2] < len(names) else f"#{row[2]}"
    return f"the {what} of module '{name or '<root>'}'"


def check_event(seq: int, kind: str, index: int, phase: str, names: Sequence[str], group: Any) -> None:
    """Raise ``RankDivergence`` unless every rank is at the same event ``seq`` of the step."""
    rows = exchange([seq, _KINDS[kind], index], group)
    if all(row == rows[0] for row in rows):
        return
    lines = [f"rank {r} is at {_describe(row, names)}" for r, row in enumerate(rows)]
    raise RankDivergence(
        f"FetchCoordinator(debug=True): ranks diverged at event {seq} of the {phase!r} step: "
        + "; ".join(lines) + ". All ranks must run the same submodules in the same order "
        "(every fetch is a collective); make data-dependent branches agree across ranks.")


def check_digest(digest: str, phase: str, group: Any) -> None:
    """Raise ``RankDivergence`` unless every rank recorded the same trace digest for the step."""
    value = int(digest, 16) & ((1 << 62) - 1)
    rows = exchange([value], group)
    if any(row != rows[0] for row in rows):
        raise RankDivergence(f"FetchCoordinator(debug=True): the {phase!r} step trace digest "
                             f"differs across ranks: {[hex(r[0]) for r in rows]}")


def check_refresh(ids: Sequence[int], phase: str, names: dict, group: Any) -> None:
    """Raise ``RankDivergence`` unless every rank re-gathers the same persistent params (by id)."""
    rows = exchange([len(ids), sum(ids), sum(i * i for i in ids) & ((1 << 62) - 1)], group)
    if all(row == rows[0] for row in rows):
        return
    counts = ", ".join(f"rank {r}: {row[0]}" for r, row in enumerate(rows))
    example = names.get(ids[0], "?") if ids else "none"
    raise RankDivergence(
        f"FetchCoordinator(debug=True): at the start of the {phase!r} step the ranks disagree on "
        f"which persistent parameters changed since they were gathered ({counts}; this rank: "
        f"{len(ids)}, e.g. '{example}'). Every rank must step (or load) its shards of the same "
        "parameters, e.g. one optimizer step on every rank.")
