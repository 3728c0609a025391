"""Named wall-clock timers that synchronise the accelerator.

    timers = Timers()
    with timers("forward"):
        loss = model(x)
    timers.elapsed(["forward"])   # {"forward": seconds} on this rank

The min/max over ranks is a collective, so it lives above the base:
``parts.observe.Timers.log`` (or ``parts.observe.log_timers`` for any ``Timers``).

Each timer accumulates the time of its start/stop intervals and counts them until it is
reset. On an accelerator, ``start`` and ``stop`` call ``torch.accelerator.synchronize()``
so that queued kernels are charged to the interval that launched them (pass
``synchronize=False`` to skip that). ``clock`` is injectable so that tests are exact.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional

from parts.base.device import synchronize_accelerator


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
