"""A ``DiskStore``'s counters (``StoreStats``) and the wall-time clocks behind them.

Two clocks per kind of operation (any, reads, writes): *busy* runs while at least one
operation of the kind is in flight (from submission to its last piece: queued, held behind
its key's previous operation, or moving bytes); *active* runs while at least one IO thread
is moving bytes of the kind (inside ``pread``/``pwrite`` or a bounce copy): the device-side
time. Bytes over active time is the bandwidth the IO path achieved; busy minus active is
time operations spent waiting in the store. The store calls ``Meter`` under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StoreStats:
    """Bytes moved and seconds spent by a store (see the module docstring for busy and active);
    ``bytes_bounced``: bytes copied through bounce buffers (direct IO of unaligned memory)."""

    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0  # transfer time summed over IO threads
    write_seconds: float = 0.0
    busy_seconds: float = 0.0
    read_busy_seconds: float = 0.0
    write_busy_seconds: float = 0.0
    active_seconds: float = 0.0
    read_active_seconds: float = 0.0
    write_active_seconds: float = 0.0
    bytes_bounced: int = 0
    wait_seconds: float = 0.0  # time callers spent blocked: IOHandle.wait(), the in-flight cap

    def snapshot(self) -> "StoreStats":
        """A copy of the counters now."""
        return StoreStats(**self.__dict__)

    def minus(self, earlier: "StoreStats") -> "StoreStats":
        """Counters accumulated since ``earlier`` (a snapshot)."""
        return StoreStats(**{k: getattr(self, k) - getattr(earlier, k) for k in self.__dict__})


class _Clock:
    """Wall time during which at least one of some things was under way."""

    def __init__(self) -> None:
        self.count, self.since = 0, 0.0

    def start(self, now: float) -> None:
        if self.count == 0:
            self.since = now
        self.count += 1

    def stop(self, now: float) -> float:
        """Seconds to add (non-zero when the last one under way ends)."""
        self.count -= 1
        return now - self.since if self.count == 0 else 0.0


class Meter:
    """Runs the busy and active clocks of ``stats`` (callers hold the store's lock)."""

    def __init__(self, stats: StoreStats) -> None:
        self.stats = stats
        self._busy = {"any": _Clock(), True: _Clock(), False: _Clock()}  # any, writes, reads
        self._active = {"any": _Clock(), True: _Clock(), False: _Clock()}

    def submitted(self, writing: bool, now: float) -> None:
        """An operation was submitted."""
        self._start(self._busy, writing, now)

    def finished(self, writing: bool, now: float) -> None:
        """An operation's last piece ended."""
        self._stop(self._busy, "busy", writing, now)

    def moving(self, writing: bool, now: float) -> None:
        """An IO thread started moving a piece's bytes."""
        self._start(self._active, writing, now)

    def moved(self, writing: bool, now: float) -> None:
        """An IO thread finished moving a piece's bytes."""
        self._stop(self._active, "active", writing, now)

    @staticmethod
    def _start(clocks: dict, writing: bool, now: float) -> None:
        clocks["any"].start(now)
        clocks[writing].start(now)

    def _stop(self, clocks: dict, name: str, writing: bool, now: float) -> None:
        """Add the clocks' elapsed time to ``<name>_seconds`` and ``<read|write>_<name>_seconds``."""
        for field_name, clock in ((f"{name}_seconds", clocks["any"]),
                                  (f"{'write' if writing else 'read'}_{name}_seconds", clocks[writing])):
            setattr(self.stats, field_name, getattr(self.stats, field_name) + clock.stop(now))
