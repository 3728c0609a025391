"""Host-memory snapshots (``parts.comm.Snapshots``) of an accelerate training loop on parts models:
two calls in the user's loop, the in-memory counterpart of ``save_state`` / ``load_state``.

    snaps = Snapshots(25)
    model, optimizer, schedule, loader = prepare(accelerator, model, optimizer, schedule, loader)
    start, position = restore_snapshot(accelerator, snaps) or (0, None)   # after a restart: the newest
    for step in range(start + 1, steps + 1):
        ...
        if snaps.due(step):
            save_snapshot(accelerator, snaps, step, position=...)
    snaps.close()                                 # a clean finish: nothing left in host memory

A snapshot holds what ``save_state`` holds for them: each parts model the accelerator prepared
(every rank's shards), its optimizers' state (shards; param groups), the prepared schedulers,
the objects given to ``register_for_checkpointing``, each rank's RNG states (Python, numpy,
torch, CUDA) and the caller's ``position`` (a data position: the same on every rank). The
restore loads them at any world size (RNG states where the world is the one that saved them)
and returns the step and ``position``; skipping the data already trained
(``accelerator.skip_first_batches``) is the loop's, as after ``load_state``.
"""

from __future__ import annotations

from typing import Any, Optional

from parts.comm import Snapshots
from parts.integrations.accelerate import _checkpointing, _optimizers_of, is_parts_model
from parts.integrations.snapshot_values import from_bytes, rng_states, set_rng_states, to_bytes
from parts.partition import (load_sharded_optimizer_state_dict, load_sharded_state_dict,
                             sharded_optimizer_state_dict, sharded_state_dict)

__all__ = ["save_snapshot", "restore_snapshot"]


def _models(accelerator: Any) -> list:
    """The parts models the accelerator prepared; any other prepared model is refused."""
    others = [type(m).__name__ for m in accelerator._models if not is_parts_model(accelerator.unwrap_model(m))]
    if others:
        raise ValueError(f"parts snapshots: the accelerator prepared model(s) {others} not sharded by parts; a "
                         f"snapshot holds parts models only (use accelerator.save_state for the others)")
    return _checkpointing(accelerator).models


def _state(accelerator: Any, position: Any) -> dict[str, Any]:
    """What a snapshot holds beside the RNG states; param groups, schedulers and objects as opaque entries."""
    record, state = _checkpointing(accelerator), {}
    for i, model in enumerate(_models(accelerator)):
        state[f"model_{i}"] = sharded_state_dict(model)
        for j, optimizer in enumerate(_optimizers_of(model, record.optimizers)):
            optim = sharded_optimizer_state_dict(model, optimizer)
            state[f"optimizer_{i}_{j}"] = {"state": optim["state"], "param_groups": to_bytes(optim["param_groups"])}
    state["schedulers"] = to_bytes([s.state_dict() for s in accelerator._schedulers])
    state["objects"] = to_bytes([o.state_dict() for o in accelerator._custom_objects])
    state["position"] = to_bytes(position)
    return state


def save_snapshot(accelerator: Any, snapshots: Snapshots, step: int, position: Any = None) -> None:
    """Snapshot the loop at ``step`` (see the module docstring); returns once it is in host memory.
    Collective: every rank calls it."""
    snapshots.save(_state(accelerator, position), step, local={"rng": rng_states()})


def restore_snapshot(accelerator: Any, snapshots: Snapshots) -> Optional[tuple[int, Any]]:
    """Load the newest snapshot of the job into what the accelerator prepared; ``(step, position)``,
    or None where there is none (nothing is changed then). Collective: every rank calls it."""
    stateless = {id(o): not any(o.state.values()) for o in _checkpointing(accelerator).optimizers}
    state = _state(accelerator, None)
    restored = snapshots.restore(state)
    if restored is None:
        for optimizer in _checkpointing(accelerator).optimizers:  # the state made to receive a snapshot
            if stateless.get(id(optimizer)):
                optimizer.state.clear()
        return None
    _load(accelerator, state)
    rng = (restored.local or {}).get("rng")
    if rng is not None:
        set_rng_states(rng)
    return restored.step, from_bytes(state["position"])


def _load(accelerator: Any, state: dict[str, Any]) -> None:
    """The restored ``state`` into the models, optimizers, schedulers and registered objects."""
    record = _checkpointing(accelerator)
    for i, model in enumerate(record.models):
        load_sharded_state_dict(model, state[f"model_{i}"])
        for j, optimizer in enumerate(_optimizers_of(model, record.optimizers)):
            saved = state[f"optimizer_{i}_{j}"]
            load_sharded_optimizer_state_dict(model, optimizer, {"state": saved["state"],
                                                                 "param_groups": from_bytes(saved["param_groups"])})
    for scheduler, saved in zip(accelerator._schedulers, from_bytes(state["schedulers"])):
        scheduler.load_state_dict(saved)
    for obj, saved in zip(accelerator._custom_objects, from_bytes(state["objects"])):
        obj.load_state_dict(saved)
