"""``Heartbeat``: every rank learns within seconds that another rank died, stopped or raised,
which rank, at which step and in which operation, and the job ends so that torchrun's agent
can restart it.

A monitor thread per rank posts a record on the default process group's store every
``interval`` seconds (``parts.comm.heartbeat_report.Record``: a growing sequence number, the
step, the operation its main thread is in, read from the main thread's stack) and reads the
records of its ring neighbours (``span`` ranks each side: every rank is watched by ``2 * span``
others, and the store serves ``2 * span + 2`` small reads per rank and beat whatever the world
size). A neighbour whose sequence number has not moved for ``timeout`` seconds is stale: a
SIGKILLed process and a SIGSTOPped one (its threads stop with it) both stop beating, while a
rank in a long step still beats, because the thread runs beside its main thread. A neighbour in
this process's namespace (the same host; ``node_id``) that missed two beats is looked up in
``/proc``: stopped (state ``T``) or dead, it is failed at once, without waiting for ``timeout``
(a healthy process is never in either state, however long its step), and a stopped one is sent
SIGKILL (``end_stopped``) once every other rank has the verdict (at most ``2 * interval``
later; its death makes torchrun's agent end the others): a stopped process answers no signal
but SIGKILL, so the agent would wait 30 s for it to end before restarting the group. A stopped
rank on another host is failed after ``timeout`` and is not signalled (no process can signal
another host's); its own agent ends it when the rendezvous restarts, 30 s after its SIGTERM. A
rank that raises out of the ``with`` block posts the error at once. The rank that sees a
failure first posts it as the job's verdict, which every rank reads at its next beat.

Then, on every rank: the failure is printed on stderr, the main thread is interrupted (by
SIGUSR2 where the program leaves that signal alone, so a SIGINT handler of its own never sees
the interrupt; else by SIGINT) and the ``with`` block raises ``PeerFailure`` naming the rank
(an error of a collective whose peer is gone is turned into it too); a main thread that cannot
be interrupted (blocked in a collective that waits for the stopped rank: gloo's cannot be
aborted) ends the process with ``exit_code`` ``exit_after`` seconds later (``exit_after=None``
leaves that to the caller). With the defaults a failure is raised about
``timeout + 2 * interval`` seconds after it (6 s; on one host a stopped or dead rank within
about ``3 * interval``, 1.5 s) and every rank has exited about ``exit_after`` seconds later.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time
import uuid
import weakref
from datetime import timedelta
from types import TracebackType
from typing import Any, Optional

from torch.optim.optimizer import register_optimizer_step_post_hook

from parts._compat import default_store
from parts.comm.group import GroupArg, group_info
from parts.comm.heartbeat_report import (PeerFailure, Record, from_verdict, is_comm_error, main_thread_op,
                                         new_record, process_state, raised, raised_at, stale, stopped,
                                         verdict_text)
from parts.comm.objects import all_gather_objects, broadcast_object


class Heartbeat:
    """A monitor thread per rank that names a failed peer within seconds (see the module
    docstring). Collective: every rank of ``group`` starts it (``with Heartbeat(): ...``)."""

    def __init__(self, group: GroupArg = None, *, interval: float = 0.5, timeout: float = 5.0,
                 exit_after: Optional[float] = 2.0, exit_code: int = 1, span: int = 2,
                 end_stopped: bool = True) -> None:
        if not 0 < interval < timeout:
            raise ValueError(f"Heartbeat: interval ({interval}) must be positive and below timeout ({timeout})")
        self.group, self.interval, self.timeout, self.span = group, interval, timeout, span
        self.exit_after, self.exit_code, self.end_stopped = exit_after, exit_code, end_stopped
        self._failure: Optional[PeerFailure] = None
        self._failed, self._stopping = threading.Event(), threading.Event()
        self._step: Optional[int] = None
        self._optimizer_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._thread: Optional[threading.Thread] = None
        self._signal, self._own_handler = signal.SIGINT, False  # how the thread interrupts the main thread
        self._to_end: Optional[tuple[int, int]] = None  # a stopped peer's pid and group rank, to SIGKILL
        self._lock, self._exiting, self._interrupted = threading.Lock(), False, False
        self.thread_cpu_s = 0.0  # CPU time the monitor thread has used (what it costs)

    # ------------------------------------------------------------ the caller's side
    def start(self) -> "Heartbeat":
        """Agree on this run's keys, post the first record on every rank, start the thread."""
        info = group_info(self.group, "parts.comm.Heartbeat")
        self.rank, self.world_size = info.rank, info.world_size
        if info.world_size == 1:
            return self
        token = broadcast_object(uuid.uuid4().hex if info.rank == 0 else None, 0, info.group)
        self._base = f"parts/heartbeat/{token}/"
        self._record = new_record(info.global_ranks()[info.rank])
        self._store = default_store().clone()
        self._store.set_timeout(timedelta(seconds=self.timeout))
        self._store.set(self._key(self.rank), self._record.dumps())
        all_gather_objects(None, info.group)  # every rank's first record is posted
        self._watched = sorted({(self.rank + d) % self.world_size for s in range(1, self.span + 1)
                                for d in (s, -s)} - {self.rank})
        self._hook = register_optimizer_step_post_hook(self._count_step)
        self._signal, self._own_handler = _interrupt_signal()
        self._thread = threading.Thread(target=self._run, name="parts-heartbeat", daemon=True)
        self._thread.start()
        return self

    def at_step(self, step: int) -> None:
        """The step this rank is at (the record's step; default: optimizer steps finished)."""
        self._step = step

    @property
    def failure(self) -> Optional[PeerFailure]:
        """The failure seen (None while every watched rank is alive)."""
        return self._failure

    def check(self) -> None:
        """Raise the ``PeerFailure`` seen, if any."""
        if self._failure is not None:
            raise self._failure

    def stop(self, error: Optional[BaseException] = None) -> None:
        """End the thread; post ``stopped`` (a clean end no peer reports), or ``error`` as this rank's failure."""
        if self._thread is None:
            return
        self._hook.remove()
        self._stopping.set()
        if self._own_handler and threading.current_thread() is threading.main_thread():
            signal.signal(self._signal, signal.SIG_DFL)  # the thread interrupts no more (``_exiting`` or ended)
            self._own_handler = False
        if self._failure is None:  # after a failure the thread keeps the exit_after deadline
            self._thread.join()
        self._thread = None
        if error is not None:
            self._record.state, self._record.error = "failed", f"{type(error).__name__}: {error}"
            self._record.op = raised_at(error.__traceback__)
        elif self._failure is None:
            self._record.state = "stopped"
        self._record.step = self._current_step()
        try:
            self._store.set(self._key(self.rank), self._record.dumps())
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to tell
            pass

    def __enter__(self) -> "Heartbeat":
        return self.start()

    def __exit__(self, kind: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        with self._lock:  # from here on the thread does not interrupt the main thread
            self._exiting, interrupted = True, self._interrupted
        if interrupted and not isinstance(exc, KeyboardInterrupt):
            _absorb_interrupt()
        if exc is None or isinstance(exc, PeerFailure):
            self.stop()
            return
        if self._failure is None and is_comm_error(exc):
            self._failed.wait(self.timeout + 2 * self.interval)  # a peer's death: wait to name it
        if self._failure is not None:
            self.stop()
            raise self._failure from exc
        self.stop(error=exc)

    # ------------------------------------------------------------ the thread
    def _key(self, rank: int) -> str:
        return f"{self._base}rank{rank}"

    def _count_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._optimizer_steps[optimizer] = self._optimizer_steps.get(optimizer, 0) + 1

    def _current_step(self) -> Optional[int]:
        if self._step is not None:
            return self._step
        return max(self._optimizer_steps.values(), default=0)

    def _run(self) -> None:
        seen: dict[int, tuple[int, float]] = {}
        store_down: Optional[float] = None
        while not self._stopping.wait(self.interval):
            try:
                self._beat()
                failure = self._verdict() or self._look(seen)
                store_down = None
            except Exception as exc:  # noqa: BLE001 - a store that stays unreachable is a failure too
                store_down = store_down or time.monotonic()
                failure = None if time.monotonic() - store_down < self.timeout else PeerFailure(
                    f"the c10d store (torchrun's agent, or rank 0) has been unreachable for "
                    f"{time.monotonic() - store_down:.1f} s: {type(exc).__name__}: {exc}",
                    rank=-1, reason="store unreachable")
            self.thread_cpu_s = time.thread_time()
            if failure is not None:
                self._fail(failure)
                return

    def _beat(self) -> None:
        record = self._record
        record.seq, record.step, record.op = record.seq + 1, self._current_step(), main_thread_op()
        self._store.set(self._key(self.rank), record.dumps())

    def _verdict(self) -> Optional[PeerFailure]:
        key = self._base + "verdict"
        return from_verdict(self._store.get(key)) if self._store.check([key]) else None

    def _look(self, seen: dict[int, tuple[int, float]]) -> Optional[PeerFailure]:
        """The first watched rank that raised or went stale, if any."""
        now = time.monotonic()
        for rank, raw in zip(self._watched, self._store.multi_get([self._key(r) for r in self._watched])):
            record = Record.loads(raw)
            if record.state == "failed":
                return raised(record)
            if record.state == "stopped":
                continue
            last = seen.get(rank)
            if last is None or last[0] != record.seq:
                seen[rank] = (record.seq, now)
            elif now - last[1] > self.timeout:
                return stale(record, now - last[1])
            elif now - last[1] > 2 * self.interval and self._sees(record):
                failure = self._stopped_or_dead(record, now - last[1], rank)
                if failure is not None:
                    return failure
        return None

    def _sees(self, record: Record) -> bool:
        """True when ``record``'s pid is a process of this namespace (the same host)."""
        return bool(record.node) and record.node == self._record.node and record.pid > 0

    def _stopped_or_dead(self, record: Record, age: float, rank: int) -> Optional[PeerFailure]:
        """The failure of group rank ``rank``, of this host, whose process is stopped (sent SIGKILL
        with ``end_stopped``) or dead; None while it runs (a slow step: the thread was held up)."""
        state = process_state(record.pid)
        if state not in ("T", "Z", "gone"):
            return None
        if state == "T" and self.end_stopped:
            self._to_end = (record.pid, rank)  # ended once the others were told (``_end_stopped``)
        return stopped(record, age, state)

    def _fail(self, failure: PeerFailure) -> None:
        """Post the verdict (the first one posted wins), tell the main thread, and end the process
        ``exit_after`` seconds later if it is still running."""
        try:
            posted = self._store.compare_set(self._base + "verdict", "", verdict_text(failure, self.rank))
            if failure.rank != -1:
                failure = from_verdict(posted)
        except Exception:  # noqa: BLE001 - the store is gone: this rank's own view stands
            pass
        self._say(str(failure))
        with contextlib.suppress(Exception):  # the store is gone: no peer waits for this rank
            self._store.set(f"{self._base}told{self.rank}", "1")
        if self._to_end is not None:
            self._end_stopped(*self._to_end)
        with self._lock:
            self._failure = failure
            self._failed.set()
            if not self._exiting:
                self._interrupted = True
                _thread.interrupt_main(self._signal)
        if self.exit_after is not None:
            time.sleep(self.exit_after)
            self._say(f"still running {self.exit_after} s after the failure was raised; exiting with {self.exit_code}")
            os._exit(self.exit_code)

    def _end_stopped(self, pid: int, rank: int) -> None:
        """SIGKILL the stopped group rank ``rank`` once every other rank has the verdict (at most
        ``2 * interval`` later): its death makes torchrun's agent end the others at once."""
        told = [f"{self._base}told{r}" for r in range(self.world_size) if r != rank]
        deadline = time.monotonic() + 2 * self.interval
        with contextlib.suppress(Exception):  # the store is gone: end it now
            while not self._store.check(told) and time.monotonic() < deadline:
                time.sleep(0.01)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)

    def _say(self, text: str) -> None:
        """One line on stderr in one write, so that the lines of the job's other processes never split it."""
        sys.stderr.write(f"parts.comm.Heartbeat on rank {self._record.rank}: {text}\n")
        sys.stderr.flush()


def _interrupt_signal() -> tuple[int, bool]:
    """The signal the thread interrupts the main thread with, and whether ``start`` installed its
    handler: SIGUSR2 raising KeyboardInterrupt where this is the main thread and nothing handles
    SIGUSR2 (so a handler the program set for SIGINT never sees it); else SIGINT."""
    spare = getattr(signal, "SIGUSR2", None)
    if spare is None or threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(spare) != signal.SIG_DFL:
        return signal.SIGINT, False
    signal.signal(spare, _raise_keyboard_interrupt)
    return spare, True


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    """The handler of the heartbeat's interrupt: what Python's SIGINT handler does."""
    raise KeyboardInterrupt


def _absorb_interrupt(limit_s: float = 1.0) -> None:
    """Take the KeyboardInterrupt the thread sent the main thread, still pending (it is
    delivered at the next bytecode boundary), so that it does not replace the error raised."""
    end = time.monotonic() + limit_s
    try:
        while time.monotonic() < end:
            time.sleep(0.001)
    except KeyboardInterrupt:
        pass
