"""The fetch coordinator: hooks that gather parameters before each submodule runs, release
them after, prefetch along a recorded trace and reduce-scatter grads. Built on ``core``."""

from parts.partition.coordinator.api import attach, detach, register_external_parameter
from parts.partition.coordinator.coordinator import FetchCoordinator
from parts.partition.coordinator.debug import RankDivergence
from parts.partition.coordinator.stats import CoordinatorStats

__all__ = ["FetchCoordinator", "attach", "detach", "register_external_parameter",
           "RankDivergence", "CoordinatorStats"]
