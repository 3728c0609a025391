"""``CheckpointPolicy``: how one checkpoint call keeps its inputs until backward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from parts.comm import GroupArg, WeakGroup, check_member
from parts.checkpoint.buffers import ContiguousBuffers
from parts.checkpoint.rng import RNGTracker
from parts.base import Timers


@dataclass(frozen=True)
class CheckpointPolicy:
    """Options of a checkpoint call; one policy object can be shared by every layer.

    - ``partition_group``: split every saved floating-point input across this group's
      ranks (each keeps a 1/N share, padded) and all-gather it back in backward. The
      input must be identical on every rank of the group (model-parallel replicas).
    - ``cpu_offload``: keep saved inputs on the CPU (pinned where an accelerator exists).
    - ``buffers``: copy saved inputs into preallocated per-layer ``ContiguousBuffers``.
    - ``synchronize``: synchronise the accelerator around forward and recompute.
    - ``profile``: time forward, recompute and gather into ``timers``.
    - ``check_replicated``: debug; verify on every call (one all-gather of checksums)
      that the inputs to partition are identical across ``partition_group``.
    - ``rng_tracker``: an ``RNGTracker`` whose streams are replayed with the CPU and
      accelerator generators.
    """

    partition_group: GroupArg = WeakGroup()  # held weakly: see parts.comm.WeakGroup
    cpu_offload: bool = False
    buffers: Optional[ContiguousBuffers] = None
    synchronize: bool = False
    profile: bool = False
    check_replicated: bool = False
    rng_tracker: Optional[RNGTracker] = None
    timers: Timers = field(default_factory=Timers, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("cpu_offload", "synchronize", "profile", "check_replicated"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CheckpointPolicy.{name} must be a bool, "
                                f"got {type(getattr(self, name)).__name__}")
        if self.buffers is not None and not isinstance(self.buffers, ContiguousBuffers):
            raise TypeError(f"CheckpointPolicy.buffers must be ContiguousBuffers or None, "
                            f"got {type(self.buffers).__name__}")
        if self.rng_tracker is not None and not isinstance(self.rng_tracker, RNGTracker):
            raise TypeError(f"CheckpointPolicy.rng_tracker must be an RNGTracker or None, "
                            f"got {type(self.rng_tracker).__name__}")
        check_member(self.partition_group, "CheckpointPolicy.partition_group")
        if self.check_replicated and self.partition_group is None:
            raise ValueError("CheckpointPolicy.check_replicated needs a partition_group to check")
