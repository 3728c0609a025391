"""The IO threads of a ``DiskStore`` and their queue: reads before writes, each key in order.

A store operation (``Op``: one read or write of a key) is split into pieces, each a call
run on one of the queue's threads. Pieces wait in one priority queue, urgent reads (a shard
an all-gather will soon wait for, with compute behind it) ahead of other reads (optimizer
state read ahead) ahead of writes, each lane first in, first out, so a read issued ahead is
not held behind unrelated writes already queued: at most behind the pieces the threads are
running. Ordering per key: an op that must follow another (``after``: the
key's previous operation) is held aside until that one is done, and only then queued, so
no thread ever blocks waiting for another op and a read of a key still sees every earlier
write of it, even though reads overtake writes in the queue.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from typing import Callable, Optional

URGENT, READ, WRITE = 0, 1, 2
"""Queue lanes, served in this order."""


class Op:
    """One read or write of a key: ``remaining`` pieces to run; ``finished`` set once done."""

    def __init__(self, pieces: int, nbytes: int, key: str, after: Optional["Op"], writing: bool,
                 urgent: bool = False) -> None:
        self.remaining, self.nbytes, self.key, self.after, self.writing = pieces, nbytes, key, after, writing
        self.lane = WRITE if writing else URGENT if urgent else READ
        self.error: Optional[BaseException] = None
        self.finished = threading.Event()
        self.held: list[tuple[int, list[Callable[[], None]]]] = []  # (lane, pieces) of ops that follow it


class IOQueue:
    """``threads`` daemon threads running the pieces of submitted ops (see the module docstring)."""

    def __init__(self, threads: int, name: str) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[int, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._stopped = False
        self._workers = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for worker in self._workers:
            worker.start()

    def submit(self, op: Op, pieces: list[Callable[[], None]]) -> None:
        """Queue ``op``'s pieces in its lane, or hold them until ``op.after`` is done."""
        lane = op.lane
        with self._cond:
            after = op.after
            if after is not None and not after.finished.is_set():
                after.held.append((lane, pieces))
                return
            self._push(lane, pieces)

    def done(self, op: Op) -> None:
        """Mark ``op`` finished and queue the ops held behind it; ``op`` lets go of the op it
        followed (its ordering is settled), so a key's history is never longer than its ops
        still pending, however many ran before."""
        with self._cond:
            op.after = None
            op.finished.set()
            for lane, pieces in op.held:
                self._push(lane, pieces)
            op.held = []

    def stop(self) -> None:
        """Let the threads exit once the queue is empty (the caller waited for its ops first)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def join(self) -> None:
        """Wait for the threads to exit (after ``stop``)."""
        for worker in self._workers:
            if worker is not threading.current_thread():
                worker.join()

    def _push(self, lane: int, pieces: list[Callable[[], None]]) -> None:
        for piece in pieces:
            heapq.heappush(self._heap, (lane, next(self._seq), piece))
        self._cond.notify(len(pieces))

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._stopped:
                    self._cond.wait()
                if not self._heap:
                    return
                piece = heapq.heappop(self._heap)[2]
            piece()
            del piece
