"""Named wall-clock timers that synchronise the accelerator, with a min/max-across-ranks log.

    timers = Timers()
    timers("forward").start(); loss = model(x); timers("forward").stop()
    timers.log(["forward"], normalizer=steps)   # rank 0 prints min/max over ranks, in ms

Each timer accumulates the time of its start/stop intervals and counts them until it is
reset. On an accelerator, ``start`` and ``stop`` call ``torch.accelerator.synchronize()``
so that queued kernels are charged to the interval that launched them (pass
``synchronize=False`` to skip that). ``clock`` is injectable so that tests are exact.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional

import torch

from parts.base.device import synchronize_accelerator
from parts.comm import GroupArg, group_info, min_max


class Timer:
    """One named timer: accumulated seconds and the number of start/stop intervals."""

    def __init__(self, name: str, clock: Callable[[], float] = time.perf_counter,
                 synchronize: bool = True) -> None:
        self.name = name
        self._clock = clock
        self._synchronize = synchronize
        self._total = 0.0
        self._count = 0
        self._started_at: Optional[float] = None

    @property
    def running(self) -> bool:
        """True between ``start()`` and ``stop()``."""
        return self._started_at is not None

    @property
    def count(self) -> int:
        """Completed start/stop intervals since the last reset."""
        return self._count

    def start(self) -> "Timer":
        """Start an interval; raises if this timer is already running."""
        if self.running:
            raise RuntimeError(f"timer {self.name!r} is already started")
        if self._synchronize:
            synchronize_accelerator()
        self._started_at = self._clock()
        return self

    def stop(self) -> "Timer":
        """End the running interval and add it to the total; raises if not running."""
        if not self.running:
            raise RuntimeError(f"timer {self.name!r} is not started")
        if self._synchronize:
            synchronize_accelerator()
        self._total += self._clock() - self._started_at
        self._count += 1
        self._started_at = None
        return self

    def reset(self) -> None:
        """Forget the accumulated time and count (a running interval keeps running)."""
        self._total = 0.0
        self._count = 0

    def elapsed(self, reset: bool = True) -> float:
        """Accumulated seconds (a running interval included so far); resets if ``reset``."""
        was_running = self.running
        if was_running:
            self.stop()
        total = self._total
        if reset:
            self.reset()
        if was_running:
            self.start()
        return total

    def mean(self) -> float:
        """Mean seconds per completed interval since the last reset (0.0 when none)."""
        return self._total / self._count if self._count else 0.0

    def __enter__(self) -> "Timer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class Timers:
    """A registry of named ``Timer`` objects: ``timers(name)`` creates on first use."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 synchronize: bool = True) -> None:
        self._clock = clock
        self._synchronize = synchronize
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        """The timer called ``name``, created stopped on first use."""
        if name not in self._timers:
            self._timers[name] = Timer(name, self._clock, self._synchronize)
        return self._timers[name]

    def __contains__(self, name: str) -> bool:
        return name in self._timers

    def names(self) -> list[str]:
        """Names of the timers created so far, in creation order."""
        return list(self._timers)

    def elapsed(self, names: Optional[Iterable[str]] = None, reset: bool = True) -> dict[str, float]:
        """Local accumulated seconds per name (0.0 for a name never started)."""
        names = self.names() if names is None else list(names)
        return {n: self._timers[n].elapsed(reset) if n in self._timers else 0.0 for n in names}

    def log(self, names: Optional[Iterable[str]] = None, normalizer: float = 1.0,
            reset: bool = True, group: GroupArg = None,
            printer: Callable[[str], None] = print) -> dict[str, tuple[float, float]]:
        """Min/max over ``group`` of each timer's seconds / ``normalizer``; rank 0 prints them in ms.

        Every rank of ``group`` must call this with the same ``names`` (it is a collective
        when torch.distributed is initialised); a name a rank never started counts as 0 s.
        """
        if normalizer <= 0:
            raise ValueError(f"Timers.log: normalizer must be > 0, got {normalizer}")
        local = self.elapsed(names, reset=reset)
        lo, hi = min_max(torch.tensor(list(local.values()), dtype=torch.float64), group)
        result = {n: (lo[i].item() / normalizer, hi[i].item() / normalizer)
                  for i, n in enumerate(local)}
        if group_info(group, "Timers.log").rank == 0 and result:
            printer("time (ms) min/max | " + " | ".join(
                f"{n}: {a * 1e3:.2f}/{b * 1e3:.2f}" for n, (a, b) in result.items()))
        return result
