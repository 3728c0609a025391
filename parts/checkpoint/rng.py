"""Random-number state: named RNG streams (``RNGTracker``) and whole-program snapshots.

A checkpointed function must draw exactly the same random numbers when it is recomputed
in backward as it drew in forward (dropout masks), and recomputing must not disturb the
randomness of the rest of the program. ``RNGSnapshot`` captures the CPU generator, the
current accelerator's generator (where there is one) and every stream of an
``RNGTracker``; ``replay`` restores a snapshot for the duration of a block and then puts
back whatever state it found.

``RNGTracker`` keeps named streams, e.g. one for model-parallel regions whose dropout
must differ across tensor-parallel ranks; ``with tracker.fork(name):`` swaps the default
generator of the tracker's device to that stream and back. There is no global tracker:
create one (or let ``seed_model_parallel`` create it) and pass it where it is needed.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from parts.base import accelerator_device
from parts.comm import GroupArg, group_info

MODEL_PARALLEL_RNG = "model-parallel-rng"
MODEL_PARALLEL_SEED_OFFSET = 2718


def get_rng_state(device: torch.device) -> torch.Tensor:
    """State of the default generator of ``device`` (CPU or an accelerator)."""
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device.index)


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    """Set the state of the default generator of ``device``."""
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device.index)


def seeded_state(seed: int, device: torch.device) -> torch.Tensor:
    """A generator state for ``device`` seeded with ``seed``, without touching the default generator."""
    return torch.Generator(device=device).manual_seed(seed).get_state()


class RNGTracker:
    """Named RNG streams for one device, forked into the default generator with ``fork(name)``."""

    def __init__(self, device: Optional[torch.device | str] = None) -> None:
        self.device = torch.device(device) if device is not None else (
            accelerator_device() or torch.device("cpu"))
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: dict[str, int] = {}
        self._active: set[str] = set()

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``; names and seeds must be unique."""
        if name in self._states:
            raise ValueError(f"RNGTracker: stream {name!r} already exists")
        for other, other_seed in self._seeds.items():
            if other_seed == seed:
                raise ValueError(f"RNGTracker: seed {seed} for {name!r} is already used by {other!r}")
        self._states[name] = seeded_state(seed, self.device)
        self._seeds[name] = seed

    def remove(self, name: str) -> None:
        """Forget stream ``name``."""
        self._check(name)
        del self._states[name], self._seeds[name]

    def names(self) -> list[str]:
        """Names of the streams, in creation order."""
        return list(self._states)

    def __contains__(self, name: str) -> bool:
        return name in self._states

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's current state."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the streams' states (those named in ``states``; all must exist)."""
        for name in states:
            self._check(name)
        for name, state in states.items():
            self._states[name] = state.clone()

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default generator is restored after."""
        self._check(name)
        if name in self._active:
            raise RuntimeError(f"RNGTracker: stream {name!r} is already forked (nested fork)")
        outer = get_rng_state(self.device)
        set_rng_state(self._states[name], self.device)
        self._active.add(name)
        try:
            yield
        finally:
            self._active.discard(name)
            self._states[name] = get_rng_state(self.device)
            set_rng_state(outer, self.device)

    def _check(self, name: str) -> None:
        if name not in self._states:
            raise KeyError(f"RNGTracker: no stream named {name!r} (have {self.names()})")


def seed_model_parallel(seed: int, group: GroupArg = None,
                        tracker: Optional[RNGTracker] = None, name: str = MODEL_PARALLEL_RNG,
                        offset: int = MODEL_PARALLEL_SEED_OFFSET) -> RNGTracker:
    """Seed stream ``name`` with ``seed + offset + rank in group`` and return the tracker.

    The stream differs across the ranks of the model-parallel ``group`` and is identical
    for the same rank of different data-parallel replicas. The default generator is untouched.
    """
    tracker = tracker if tracker is not None else RNGTracker()
    if name in tracker:
        tracker.remove(name)
    tracker.add(name, seed + offset + group_info(group).rank)
    return tracker


@dataclass(frozen=True)
class RNGSnapshot:
    """CPU, accelerator and tracked-stream RNG states at one moment."""

    cpu: torch.Tensor
    accelerator: Optional[tuple[torch.device, torch.Tensor]]
    tracked: Optional[dict[str, torch.Tensor]]

    @staticmethod
    def capture(tracker: Optional[RNGTracker] = None) -> "RNGSnapshot":
        """Snapshot the CPU generator, the current accelerator's and ``tracker``'s streams."""
        device = accelerator_device()
        acc = (device, get_rng_state(device)) if device is not None else None
        return RNGSnapshot(torch.get_rng_state(), acc,
                           tracker.get_states() if tracker is not None else None)

    def restore(self, tracker: Optional[RNGTracker] = None) -> None:
        """Put every captured state back."""
        torch.set_rng_state(self.cpu)
        if self.accelerator is not None:
            set_rng_state(self.accelerator[1], self.accelerator[0])
        if tracker is not None and self.tracked is not None:
            tracker.set_states(self.tracked)


@contextmanager
def replay(snapshot: RNGSnapshot, tracker: Optional[RNGTracker] = None) -> Iterator[None]:
    """Run the block with ``snapshot``'s RNG states; restore the states found on entry after."""
    found = RNGSnapshot.capture(tracker)
    snapshot.restore(tracker)
    try:
        yield
    finally:
        found.restore(tracker)
