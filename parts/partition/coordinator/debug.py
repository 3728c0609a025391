"""Debug mode of the fetch coordinator: check that every rank runs the same collective sequence.

Every collective needs all ranks to call it in the same order; a rank that runs a submodule
the others skip, or evaluates while the others train, hangs them all (or, with gloo, aborts
in a collective whose sizes do not match). With ``debug=True`` the coordinator first
agrees with the other ranks on a ``DebugPoint`` before every collective it may issue in a
step: the step start (persistent-params refresh), every fetch, every prefetch all-gather,
every external-parameter fetch, every grad reduce-scatter, the check of ``requires_grad`` at
a backward's start and the step end (with the trace digest). The point is exchanged as a
fixed-length int64 record (the same size on every rank, whatever the rank is doing), so ranks
at different points always meet in that exchange and raise ``RankDivergence`` on every rank,
naming what each rank was doing. Costs one small all-gather per point: a debugging aid, not
for production runs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

import torch
from parts.comm import GroupArg, WeakGroup, all_gather, comm_tensor, group_info, to_host
from parts.partition.coordinator.step import StepState

KINDS = ("start", "F", "B", "prefetch", "external", "reduce", "end", "outside", "flags")
_PHASE_WORDS = 3  # the phase name travels as 24 UTF-8 bytes (longer names are cut)
RECORD_LEN = _PHASE_WORDS + 6
_MASK = (1 << 62) - 1


class RankDivergence(RuntimeError):
    """Ranks ran different submodule sequences (they would deadlock in a collective)."""


@dataclass(frozen=True)
class DebugPoint:
    """Where a rank is: phase, its step number in that phase, event number, what it does."""

    phase: str
    step: int
    seq: int
    kind: str
    module: int = -1  # index into the coordinator's module names (-1: none)
    count: int = 0  # parameters / gradients in the collective
    digest: int = 0  # of the params' ids (or of the step trace at "end")


def ids_digest(ids: Sequence[int]) -> int:
    """A 62-bit digest of a sequence of ints, the same in every process."""
    raw = hashlib.blake2b(",".join(map(str, ids)).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") & _MASK


def encode(point: DebugPoint) -> list[int]:
    """The fixed-length (``RECORD_LEN``) int record of ``point``."""
    name = point.phase.encode()[:8 * _PHASE_WORDS].ljust(8 * _PHASE_WORDS, b"\0")
    words = [int.from_bytes(name[8 * k:8 * k + 8], "little", signed=True) for k in range(_PHASE_WORDS)]
    return words + [point.step, point.seq, KINDS.index(point.kind), point.module,
                    point.count, point.digest & _MASK]


def decode(row: Sequence[int]) -> DebugPoint:
    """Inverse of ``encode``."""
    name = b"".join(int(w).to_bytes(8, "little", signed=True) for w in row[:_PHASE_WORDS])
    step, seq, kind, module, count, digest = (int(v) for v in row[_PHASE_WORDS:])
    kind_name = KINDS[kind] if 0 <= kind < len(KINDS) else "?"
    return DebugPoint(name.rstrip(b"\0").decode(errors="replace"), step, seq, kind_name, module,
                      count, digest)


def _module(point: DebugPoint, names: Sequence[str]) -> str:
    name = names[point.module] if 0 <= point.module < len(names) else f"#{point.module}"
    return f"'{name or '<root>'}'"


def describe(point: DebugPoint, names: Sequence[str]) -> str:
    """What a rank at ``point`` is doing, e.g. ``the forward of module 'blocks.2' (event 5 of train step 1)``."""
    if point.kind == "outside":
        return (f"`{point.phase}` outside any step, after {point.step} steps begun "
                f"({point.count} of them train steps)")
    if point.kind == "flags":
        return "the check of requires_grad at the start of a backward"
    what = {
        "start": f"the start of its step, re-gathering {point.count} persistent parameters",
        "F": f"the forward of module {_module(point, names)}",
        "B": f"the backward of module {_module(point, names)}",
        "prefetch": f"a prefetch of {point.count} parameters for module {_module(point, names)}",
        "external": f"a fetch of an external parameter in module {_module(point, names)}",
        "reduce": f"a reduce-scatter of {point.count} gradients",
        "end": "the end of its step",
    }.get(point.kind, f"an unknown event {point.kind!r}")
    return f"{what} (event {point.seq} of {point.phase} step {point.step})"


def _same_place(points: Sequence[DebugPoint]) -> bool:
    first = points[0]
    return all((p.phase, p.step, p.seq, p.kind) == (first.phase, first.step, first.seq, first.kind)
               for p in points)


def divergence_message(points: Sequence[DebugPoint], names: Sequence[str]) -> str:
    """The ``RankDivergence`` message for the decoded points of all ranks (rank order)."""
    head = "FetchCoordinator(debug=True): "
    if _same_place(points) and points[0].kind == "start":
        counts = ", ".join(f"rank {r}: {p.count}" for r, p in enumerate(points))
        return (head + f"at the start of {points[0].phase} step {points[0].step} the ranks disagree "
                f"on which persistent parameters changed since they were gathered ({counts}). Every "
                "rank must step (or load) its shards of the same parameters, e.g. one optimizer "
                "step on every rank.")
    if _same_place(points) and points[0].kind == "end":
        return (head + f"the {points[0].phase} step {points[0].step} trace digest differs across "
                f"ranks: {[hex(p.digest) for p in points]}")
    lines = [f"rank {r} is at {describe(p, names)}" for r, p in enumerate(points)]
    if any(p.kind == "outside" for p in points):
        return (head + "ranks are at different steps: " + "; ".join(lines) + ". Every rank must "
                "run the same number of steps (batches) before a collective outside a step: "
                "skip a batch on every rank or none, and give every rank as many batches.")
    return (head + f"ranks diverged at event {min(p.seq for p in points)}: " + "; ".join(lines)
            + ". All ranks must run the same submodules in the same order and phase (every fetch "
            "is a collective); make data-dependent branches, train/eval switches and requires_grad "
            "(a frozen module runs no backward) agree across ranks.")


def exchange(values: Sequence[int], group: GroupArg) -> list[list[int]]:
    """All-gather a short list of ints from every rank of ``group`` (rank order)."""
    info = group_info(group, "FetchCoordinator(debug=True)")
    mine = comm_tensor(list(values), torch.int64, info)
    out = torch.empty(info.world_size * mine.numel(), dtype=torch.int64, device=mine.device)
    all_gather(out, mine, info)
    return to_host(out).view(info.world_size, -1).tolist()  # one host copy per check


def check_point(point: DebugPoint, names: Sequence[str], group: GroupArg, ids: Sequence[int] = (),
                param_names: Optional[Mapping[int, str]] = None) -> None:
    """Raise ``RankDivergence`` on every rank unless all ranks of ``group`` are at ``point``; ranks
    reducing different grads at the same reduce-scatter exchange their ``ids`` to name them."""
    rows = exchange(encode(point), group)
    if all(row == rows[0] for row in rows):
        return
    points = [decode(row) for row in rows]
    message = divergence_message(points, names)
    if param_names is not None and _same_place(points) and points[0].kind == "reduce":
        width = max(p.count for p in points)  # every rank sees the same rows: all exchange again
        sets = [set(row) - {-1} for row in exchange(list(ids) + [-1] * (width - len(ids)), group)]
        message += differing_grads(sets, param_names)
    raise RankDivergence(message)


def differing_grads(sets: Sequence[set], param_names: Mapping[int, str], limit: int = 5) -> str:
    """The parameters some ranks reduce a grad of and others do not (``sets``: ids per rank)."""
    every = set.intersection(*sets)
    odd = sorted(set.union(*sets) - every, key=lambda pid: param_names.get(pid, str(pid)))
    parts = [f"'{param_names.get(pid, pid)}' on rank(s) {[r for r, s in enumerate(sets) if pid in s]} only"
             for pid in odd[:limit]]
    more = f" and {len(odd) - limit} more" if len(odd) > limit else ""
    return (f" The ranks reduce grads of different parameters: {', '.join(parts)}{more}. Set "
            "requires_grad alike on every rank, and use the same parameters in every rank's forward.")


class StepCheck:
    """Debug mode's agreement before each collective of a step (off: does nothing).

    Every piece of the coordinator that issues a collective calls ``point`` first, with the
    step it belongs to; the step's event counter ``seq`` advances with each point.
    """

    group = WeakGroup()  # not kept alive past destroy_process_group (see WeakGroup)

    def __init__(self, enabled: bool, names: Sequence[str], group: GroupArg,
                 param_names: Optional[Mapping[int, str]] = None) -> None:
        self.enabled, self.names, self.group = enabled, names, group
        self.param_names = param_names  # stable id -> name: a differing reduce-scatter names them

    def point(self, step: Optional[StepState], kind: str, module: int = -1, ids: Iterable[int] = (),
              digest: Optional[int] = None) -> None:
        """Agree with every rank on (phase, step, event, kind, module, ids) or raise ``RankDivergence``."""
        if not self.enabled:
            return
        ids = list(ids)
        if step is None:  # no step in progress (cannot happen when the ranks agree)
            step = StepState("?", number=-1, seq=-1)
        point = DebugPoint(step.phase, step.number, step.seq, kind, module, len(ids),
                           ids_digest(ids) if digest is None else digest)
        step.seq += 1
        check_point(point, self.names, self.group, ids, self.param_names)

    def outside(self, what: str, steps: int, train_steps: int) -> None:
        """Agree on a collective outside any step (a state dict, an optimizer step, detach) and on
        the steps each rank began: one rank a batch ahead or behind raises on every rank."""
        if not self.enabled:
            return
        point = DebugPoint(what, steps, -1, "outside", -1, train_steps,
                           ids_digest([ord(c) for c in what]))
        check_point(point, self.names, self.group)
