"""The module-level entry points of the coordinator: ``attach``, ``detach``,
``register_external_parameter``, ``refresh``, ``set_replica_sync``, ``no_sync``."""

from __future__ import annotations

from typing import Any, ContextManager, Optional, Union

from torch import nn

from parts.partition.coordinator.checks import agree_to_attach
from parts.partition.coordinator.coordinator import FetchCoordinator, attached_to


def attach(module: nn.Module, coordinator: Optional[FetchCoordinator] = None, **knobs: Any) -> FetchCoordinator:
    """Hook ``module`` (already sharded) so plain ``model(x); loss.backward()`` runs ZeRO-3."""
    if coordinator is not None and knobs:
        raise ValueError(f"attach: pass knobs to FetchCoordinator(...) or to attach(), not both "
                         f"(got a coordinator and {sorted(knobs)})")
    if coordinator is None:
        try:
            coordinator = FetchCoordinator(**knobs)
        except (TypeError, ValueError) as err:  # a bad knob on one rank: every rank raises
            agree_to_attach(module, None, None, failed=err)
    return coordinator.attach(module)


def detach(module_or_coordinator: Union[nn.Module, "FetchCoordinator"]) -> None:
    """Remove the coordinator hooks from a model (or detach the given coordinator)."""
    if isinstance(module_or_coordinator, FetchCoordinator):
        module_or_coordinator.detach()
        return
    coordinator = attached_to(module_or_coordinator)
    if coordinator is not None:
        coordinator.detach()


def register_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``param`` of another module (fetch it with ``module``)."""
    coordinator = attached_to(module)
    if coordinator is None:
        raise RuntimeError(f"register_external_parameter: {type(module).__name__} is not part of a "
                           "model with an attached FetchCoordinator; call attach(model) first")
    coordinator.register_external_parameter(module, param)


def refresh(module: nn.Module) -> None:
    """Gather again what an attached model keeps gathered whose shards were written outside an
    optimizer step (reads.py), so reads see them; a collective if any: call it on every rank."""
    coordinator = attached_to(module)
    if coordinator is None:
        raise RuntimeError(f"refresh: {type(module).__name__} has no attached FetchCoordinator; "
                           "without one, parts.partition.gather(params) fetches current values")
    coordinator.steps.refresh()


def set_replica_sync(module_or_coordinator: Union[nn.Module, FetchCoordinator], when: str) -> None:
    """Hybrid layouts: when grad shards are averaged across replicas. ``"backward"`` (the
    default): during every backward, each bucket as soon as its reduce-scatter landed, except in
    backwards under ``no_sync``; ``"step"``: once, right before an optimizer step or a norm reads
    them, whatever the loop says (one mean per step, never overlapped with backward)."""
    if when not in ("step", "backward"):
        raise ValueError(f"set_replica_sync: when must be 'step' or 'backward', got {when!r}")
    _attached_coordinator(module_or_coordinator, "set_replica_sync").reducer.replica_sync = when


def no_sync(module_or_coordinator: Union[nn.Module, FetchCoordinator]) -> ContextManager[None]:
    """DDP's ``no_sync`` for a hybrid layout: micro-batches run inside leave their cross-replica
    mean to the first backward outside (or the optimizer step), so gradient accumulation sends
    it once per step; results are bitwise those of ``set_replica_sync(model, "step")``."""
    return _attached_coordinator(module_or_coordinator, "no_sync").no_sync()


def _attached_coordinator(module_or_coordinator: Union[nn.Module, FetchCoordinator], caller: str) -> FetchCoordinator:
    coordinator = (module_or_coordinator if isinstance(module_or_coordinator, FetchCoordinator)
                   else attached_to(module_or_coordinator))
    if coordinator is None or coordinator._root is None:
        raise RuntimeError(f"{caller}: no attached FetchCoordinator; call attach(model) first")
    return coordinator
