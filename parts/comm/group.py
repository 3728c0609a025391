"""The one process-group handle of ``parts``: who is in a group, its size, this rank in it.

Every part resolves the ``group`` argument its user passes through here, so membership
checks, world-size checks and "not distributed" read the same everywhere. Without an
initialised ``torch.distributed`` a process is a world of one.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch.distributed as dist

ProcessGroup = dist.ProcessGroup
"""The torch process-group type (what ``torch.distributed.new_group`` returns)."""

GroupArg = Optional[ProcessGroup]
"""What a user passes as ``group``: a process group, or None for the default group."""


def is_distributed() -> bool:
    """True when torch.distributed is available and a process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def env_world_size() -> int:
    """``WORLD_SIZE`` from the environment (what a launcher such as torchrun sets), else 1."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def global_rank() -> int:
    """This process's rank in the default group (0 when not distributed)."""
    return dist.get_rank() if is_distributed() else 0


def _no_group() -> None:
    return None


def _weak(group: GroupArg) -> Callable[[], GroupArg]:
    """A callable returning ``group`` while it lives (None for None); strong only for a
    group type that takes no weak reference."""
    if group is None:
        return _no_group
    try:
        return weakref.ref(group)
    except TypeError:
        return lambda: group


class WeakGroup:
    """An attribute holding a process group weakly (None stays None: the default group).

    torch's registry holds every group until ``destroy_process_group``. A model, coordinator
    or optimizer the user keeps past ``destroy_process_group`` must not keep the group, and
    gloo's worker threads, alive into interpreter teardown: a worker still releasing a
    finished collective's tensors there takes the GIL, the finalizing interpreter ends it with
    ``pthread_exit`` and the unwind through a ``noexcept`` destructor aborts the process
    (``terminate called without an active exception``). Reading the
    attribute once the group is gone raises, naming it. Usable as a dataclass field default.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = f"{owner.__name__}.{name}", f"_weak_{name}"

    def __get__(self, obj: object, owner: Optional[type] = None) -> GroupArg:
        if obj is None:
            return None  # the default of a dataclass field
        ref = obj.__dict__.get(self.slot, _no_group)
        group = ref()
        if group is None and ref is not _no_group:
            raise RuntimeError(f"{self.name}: its process group was destroyed (destroy_process_group); "
                               "build the object again on a live group")
        return group

    def __set__(self, obj: object, group: GroupArg) -> None:
        obj.__dict__[self.slot] = _weak(group)


@dataclass(frozen=True)
class GroupInfo:
    """A resolved process group: the handle to pass to torch (None: not distributed, held
    weakly: see ``WeakGroup``), this rank in it and its size."""

    group: GroupArg = WeakGroup()
    rank: int = 0
    world_size: int = 1
    topology: Optional[object] = None  # a parts.comm.topology.Topology: all-gathers in two hops

    def global_rank(self, group_rank: int) -> int:
        """Global rank of ``group_rank`` in this group (for ``src``/``dst`` arguments)."""
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def global_ranks(self) -> list[int]:
        """Global ranks of the members, in group-rank order."""
        if self.group is None:
            return list(range(self.world_size)) if is_distributed() else [0]
        return list(dist.get_process_group_ranks(self.group))

    @property
    def backend(self) -> str:
        """The backend name of the group ("gloo", "nccl", ...; "local" when not distributed)."""
        return dist.get_backend(self.group) if self.group is not None else "local"


def is_member(group: GroupArg) -> bool:
    """True if this rank is in ``group`` (always, for the default group or without torch.distributed)."""
    if group is None or not is_distributed():
        return True
    return group is not dist.GroupMember.NON_GROUP_MEMBER and dist.get_rank(group) >= 0


def check_member(group: GroupArg, what: str) -> None:
    """Raise ValueError naming ``what``, this rank and the group's ranks if this rank is not in ``group``."""
    if is_member(group):
        return
    try:
        ranks = f"global ranks {dist.get_process_group_ranks(group)}"
    except Exception:  # noqa: BLE001 - a non-member may not see the group's ranks
        ranks = "ranks unknown to this process"
    raise ValueError(f"{what}: rank {dist.get_rank()} is not a member of the process group passed "
                     f"({ranks}); only the ranks of a group may use it")


def require_distributed(what: str) -> None:
    """Raise RuntimeError naming ``what`` unless a process group is initialised."""
    if not is_distributed():
        raise RuntimeError(f"{what} needs an initialised torch.distributed process group "
                           f"(call dist.init_process_group first, e.g. under torchrun)")


def group_info(group: GroupArg = None, what: str = "parts") -> GroupInfo:
    """``group`` resolved leniently: a world of one when not distributed (``group`` ignored)."""
    if not is_distributed():
        return GroupInfo(None, 0, 1)
    check_member(group, what)
    handle = dist.group.WORLD if group is None else group
    return GroupInfo(handle, dist.get_rank(handle), dist.get_world_size(handle))


def resolve_group(group: GroupArg = None, what: str = "parts", *,
                  group_needs_init: bool = True) -> GroupInfo:
    """``group`` resolved strictly: a launcher's ``WORLD_SIZE > 1`` without an initialised
    process group (or with a default group of one rank) raises instead of letting every rank
    silently hold everything; so does an explicit ``group`` without torch.distributed
    (unless ``group_needs_init`` is False)."""
    env = env_world_size()
    if not is_distributed():
        if group is not None and group_needs_init:
            raise RuntimeError(f"{what}: a process group was given but torch.distributed "
                               "is not initialised")
        if env > 1:
            raise RuntimeError(f"{what}: WORLD_SIZE={env} in the environment but torch.distributed "
                               "is not initialised; every rank would silently hold everything. "
                               "Call torch.distributed.init_process_group first.")
        return GroupInfo(None, 0, 1)
    info = group_info(group, what)
    if info.world_size == 1 and env > 1 and info.group is dist.group.WORLD:
        raise RuntimeError(f"{what}: the default process group has one rank but "
                           f"WORLD_SIZE={env}; every rank would silently hold everything")
    return info


def _mesh_groups(mesh: object, what: str) -> tuple[GroupArg, GroupArg]:
    """``(shard group, replicate group)`` of a ``DeviceMesh``: a 2-D mesh's dims are (replicate,
    shard) as FSDP2 takes them; a 1-D mesh shards over its one dim."""
    ndim = getattr(mesh, "ndim", None)
    if ndim == 1:
        return mesh.get_group(0), None
    if ndim != 2:
        raise ValueError(f"{what}: mesh must be a 1-D or 2-D DeviceMesh with dims (replicate, shard), "
                         f"got {mesh!r}")
    return mesh.get_group(1), mesh.get_group(0)


def hybrid_groups(group: GroupArg = None, replicate_group: GroupArg = None, mesh: object = None,
                  what: str = "parts") -> tuple[GroupInfo, Optional[GroupInfo]]:
    """The shard group and the replica group (None: no replicas) of a hybrid layout, resolved
    strictly (``resolve_group``); given as ``group``/``replicate_group`` or as a ``mesh``. The two
    groups must meet in this rank alone (a replica group of one rank is no replica group)."""
    if mesh is not None:
        if group is not None or replicate_group is not None:
            raise ValueError(f"{what}: pass either mesh= or group=/replicate_group=, not both")
        group, replicate_group = _mesh_groups(mesh, what)
    info = resolve_group(group, what)
    if replicate_group is None:
        return info, None
    replica = resolve_group(replicate_group, f"{what} (replicate_group)")
    if replica.world_size == 1:
        return info, None
    common = set(info.global_ranks()) & set(replica.global_ranks())
    if common != {global_rank()}:
        raise ValueError(f"{what}: the shard group (global ranks {info.global_ranks()}) and the "
                         f"replicate group ({replica.global_ranks()}) must share exactly this rank "
                         f"({global_rank()}), as the rows and columns of a (replicate, shard) mesh do")
    return info, replica
