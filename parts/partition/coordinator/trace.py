"""Execution traces of a model's submodules, one book per phase: pure bookkeeping, no torch.

An event is ``(kind, module_index)`` with kind ``FORWARD`` or ``BACKWARD``; a trace is the
sequence of events of one step (forward passes, then backward, including recompute forwards
of checkpointed regions). ``TraceBook`` keeps the last few distinct traces of every phase
(``"train"``, ``"eval/no_grad"``, ...) and follows the current step against them: while the
step matches a stored trace its events have a position (prefetch may plan from it); on the
first divergence the step continues on demand and is recorded as the new trace of the phase.
A miss is counted, never raised or warned about.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

FORWARD = "F"
BACKWARD = "B"

Event = tuple  # (kind: str, module_index: int)


def phase_name(training: bool, grad_enabled: bool) -> str:
    """Name of the trace book a top-level forward belongs to: ``train``, ``eval``, ``*/no_grad``."""
    return ("train" if training else "eval") + ("" if grad_enabled else "/no_grad")


@dataclass(frozen=True)
class Trace:
    """The recorded order of submodule events of one step of ``phase``."""

    phase: str
    events: tuple

    def __len__(self) -> int:
        return len(self.events)


def trace_digest(events: Sequence[Event], names: Sequence[str]) -> str:
    """Stable hex digest of a trace (by module names, so it is identical on every rank)."""
    digest = hashlib.sha1()
    for kind, index in events:
        digest.update(f"{kind}:{names[index]};".encode())
    return digest.hexdigest()[:16]


def first_divergence(a: Sequence[Event], b: Sequence[Event]) -> Optional[int]:
    """Index of the first event where ``a`` and ``b`` differ (or the shorter length); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class Observation:
    """How one event of the current step relates to the stored traces."""

    position: Optional[int]  # index of the event in ``trace``; None while fetching on demand
    trace: Optional[Trace]
    miss: bool  # this event broke away from every stored trace of the phase


@dataclass(frozen=True)
class StepRecord:
    """Outcome of one finished step: its events and whether it followed a stored trace."""

    phase: str
    events: tuple
    outcome: str  # "recorded" (no trace before), "replayed", or "diverged" (re-recorded)


@dataclass
class _Progress:
    trace: Optional[Trace]
    seen: list = field(default_factory=list)
    position: int = 0
    on_demand: bool = False
    switched: bool = False


class TraceBook:
    """Up to ``max_traces`` distinct traces per phase (most recent first) and each active step."""

    def __init__(self, max_traces: int = 4) -> None:
        if not isinstance(max_traces, int) or max_traces < 1:
            raise ValueError(f"TraceBook: max_traces must be an int >= 1, got {max_traces!r}")
        self.max_traces = max_traces
        self._traces: dict[str, list[Trace]] = {}
        self._steps: dict[str, _Progress] = {}

    def active(self, phase: str) -> bool:
        """True while a step of ``phase`` has begun and not ended."""
        return phase in self._steps

    def traces(self, phase: str) -> tuple:
        """Stored traces of ``phase``, most recent first."""
        return tuple(self._traces.get(phase, ()))

    def begin(self, phase: str) -> None:
        """Start a step of ``phase``, replaying its most recent trace if there is one."""
        if phase in self._steps:
            raise RuntimeError(f"TraceBook: a step of phase {phase!r} is already active")
        stored = self._traces.get(phase)
        self._steps[phase] = _Progress(trace=stored[0] if stored else None)

    def observe(self, phase: str, event: Event) -> Observation:
        """Record ``event`` in the active step of ``phase`` and say where it stands."""
        step = self._steps[phase]
        index = len(step.seen)
        step.seen.append(event)
        if step.on_demand:
            return Observation(None, None, False)
        if step.trace is None:
            step.on_demand = True
            return Observation(None, None, False)
        if index < len(step.trace) and step.trace.events[index] == event:
            step.position = index + 1
            return Observation(index, step.trace, False)
        other = self._matching(phase, step.seen)
        if other is not None:
            step.trace, step.position, step.switched = other, index + 1, True
            return Observation(index, other, False)
        step.on_demand = True
        return Observation(None, None, True)

    def _matching(self, phase: str, seen: list) -> Optional[Trace]:
        n = len(seen)
        for trace in self._traces.get(phase, ()):
            if len(trace) >= n and list(trace.events[:n]) == seen:
                return trace
        return None

    def end(self, phase: str) -> StepRecord:
        """Finish the active step of ``phase``; store its events as the phase's newest trace."""
        step = self._steps.pop(phase)
        events = tuple(step.seen)
        if step.trace is None and not self._traces.get(phase):
            outcome = "recorded"
        elif not step.on_demand and step.trace is not None and step.trace.events == events:
            outcome = "replayed"
        else:
            outcome = "diverged"
        self._store(phase, events)
        return StepRecord(phase, events, outcome)

    def abandon(self, phase: str) -> None:
        """Drop the active step of ``phase`` without storing anything (e.g. after an error)."""
        self._steps.pop(phase, None)

    def _store(self, phase: str, events: tuple) -> None:
        stored = self._traces.setdefault(phase, [])
        for i, trace in enumerate(stored):
            if trace.events == events:
                stored.insert(0, stored.pop(i))
                return
        stored.insert(0, Trace(phase, events))
        del stored[self.max_traces:]

    def state(self, phase: str) -> str:
        """``idle``, ``recording`` (no trace yet), ``replaying`` or ``on-demand`` (after a miss)."""
        step = self._steps.get(phase)
        if step is None:
            return "idle"
        if step.on_demand:
            return "recording" if not self._traces.get(phase) else "on-demand"
        return "replaying" if step.trace is not None else "recording"
