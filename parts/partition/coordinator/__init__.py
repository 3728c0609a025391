"""The fetch coordinator: hooks that gather parameters before each submodule runs, release
them after, prefetch along a recorded trace and reduce-scatter grads. Built on ``core``."""

from parts.partition.coordinator.api import (attach, detach, no_sync, refresh, register_external_parameter,
                                             set_replica_sync)
from parts.partition.coordinator.coordinator import FetchCoordinator, attached_to
from parts.partition.coordinator.debug import RankDivergence
from parts.partition.coordinator.stats import CoordinatorStats

__all__ = ["FetchCoordinator", "attach", "attached_to", "detach", "register_external_parameter",
           "refresh", "set_replica_sync", "no_sync", "RankDivergence", "CoordinatorStats"]
