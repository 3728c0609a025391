"""How the Lightning strategies shard a model: at construction, or when it is set up.

The knobs a strategy takes go where ``parts`` takes them: ``remote_device``, ``pin_memory``,
``replicate_group``, ``mesh`` and ``ranks_per_node`` (layouts, offload) to
``parts.partition.partitioned`` / ``partition_module``, every other one to ``attach``
(``FetchCoordinator``'s: persistence, prefetch, buckets, ``compression``, ``mixed_precision``...).
Unknown names raise when the strategy is made.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from torch import nn

from parts.integrations.attached import check_attached_precision
from parts.integrations.lightning.clip import is_parts_model
from parts.partition import MixedPrecision, attach, is_partitioned, partition_module, partitioned
from parts.partition.coordinator import FetchCoordinator, attached_to

PARTITION_KNOBS = ("remote_device", "pin_memory", "replicate_group", "mesh", "ranks_per_node")


def _attach_knobs() -> set[str]:
    params = inspect.signature(FetchCoordinator.__init__).parameters
    return {name for name in params if name not in ("self", "group")}


class Knobs:
    """A strategy's knobs, split between ``partitioned`` / ``partition_module`` and ``attach``."""

    def __init__(self, owner: str, knobs: dict[str, Any]) -> None:
        allowed = _attach_knobs()
        unknown = sorted(set(knobs) - allowed - set(PARTITION_KNOBS))
        if unknown:
            raise TypeError(f"{owner}: unknown knob(s) {unknown}; it takes Lightning's strategy arguments, "
                            f"the layout knobs {list(PARTITION_KNOBS)} and attach's {sorted(allowed)}")
        self.partition = {k: v for k, v in knobs.items() if k in PARTITION_KNOBS}
        self.attach = {k: v for k, v in knobs.items() if k not in PARTITION_KNOBS}
        self.mixed_precision: Optional[MixedPrecision] = self.attach.pop("mixed_precision", None)

    def partitioned(self, device: Optional[torch.device]) -> partitioned:
        """``partitioned(...)`` with the layout knobs: every module built inside is sharded at once."""
        return partitioned(device=device, **self.partition)


def coordinator_of(module: nn.Module) -> Optional[FetchCoordinator]:
    """The coordinator attached to ``module`` or, where the user attached a submodule, to that one."""
    for sub in module.modules():
        coordinator = attached_to(sub)
        if coordinator is not None:
            return coordinator
    return None


def _check_policy(module: nn.Module, coordinator: FetchCoordinator, policy: Optional[MixedPrecision]) -> None:
    check_attached_precision(module, coordinator, policy, "parts strategy: precision='bf16-mixed'",
                             "leave attaching to the strategy or attach with "
                             "mixed_precision=parts.partition.MixedPrecision()")


def shard_and_attach(module: nn.Module, knobs: Knobs, policy: Optional[MixedPrecision],
                     device: Optional[torch.device]) -> FetchCoordinator:
    """Shard what ``module`` holds unsharded (rank 0's values), then attach it with ``policy`` and
    the knobs, unless it (or a submodule the user attached) is attached already."""
    if any(not is_partitioned(p) for p in module.parameters()):
        partition_module(module, device=device, **knobs.partition)
    coordinator = coordinator_of(module)
    if coordinator is not None:
        _check_policy(module, coordinator, policy)
        return coordinator
    if not is_parts_model(module):
        raise ValueError(f"parts strategy: {type(module).__name__} has no parameters to shard")
    return attach(module, mixed_precision=policy, **knobs.attach)
