"""The records the coordinator's pieces pass each other: a running module call, a step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from parts.partition.coordinator.plan import StepPlan, next_use
from parts.partition.coordinator.trace import Event


@dataclass
class ModuleCall:
    """One running forward (or backward) of a hooked module and the params it holds."""

    index: int
    phase: str
    ids: list[int]  # stable ids of the parameters it holds


@dataclass
class StepState:
    """The step in progress of one phase: where it is in its trace and what prefetch covered."""

    phase: str
    position: Optional[int] = None
    plan: Optional[StepPlan] = None
    plan_key: Optional[tuple] = None
    events: tuple[Event, ...] = ()
    horizon: Optional[int] = None  # first trace position whose params prefetch has not covered
    recheck: set[int] = field(default_factory=set)  # released ids needed again before the horizon
    seq: int = 0  # debug mode: number of the next checked event of the step
    pending_backward: bool = False
    number: int = 0  # this step's index among the steps of its phase (0, 1, ...)
    no_sync: bool = False  # begun inside FetchCoordinator.no_sync(): its backward defers the replica mean

    def next_use(self, pid: int) -> Optional[int]:
        """Trace position of ``pid``'s next use after the current one (None: unknown or never)."""
        if self.plan is None or self.position is None:
            return None
        return next_use(self.plan, pid, self.position)
