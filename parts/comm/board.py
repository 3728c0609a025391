"""Exchanges between the ranks one build names, and no others, through the default store.

A collective needs every member of its group in it, so a check over the world makes every
rank take part in every build, even one that builds nothing (an evaluation rank, a pipeline
stage with another model). Here a rank posts a build's entry (its item and the global ranks
it names: its shard and replica groups) on the default process group's key-value store, which
every rank reaches already, and reads the entries of the ranks it names alone.

- Pairing: a rank's k-th build naming rank m meets m's k-th build naming it; m's builds that
  do not name it (over groups without it) are passed over. Ranks building over disjoint
  groups build as often as each likes, and a rank outside every group never blocks the others.
- ``Meeting(item, named, what, describe)``: posts ``item`` and collects the items of the
  builds it meets; ``verdicts(mine)`` then passes each rank's outcome on to the ranks it met,
  so a failure seen by one rank of a (replicate, shard) grid reaches its row and column, and
  through them every rank of the grid.
- A rank named by a build that never comes waits for the store's timeout (the default process
  group's), then raises a ``TimeoutError`` naming the ranks and what they last built.
- Entries name their ranks as runs (start, stop, step), so a build over a mesh posts a few
  integers whatever the world size.
"""

from __future__ import annotations

import pickle
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Iterable, Optional

import torch.distributed as dist

from parts._compat import default_store

_PREFIX = "parts/board/"
Runs = tuple[tuple[int, int, int], ...]


def runs(ranks: Iterable[int]) -> Runs:
    """``ranks`` (sorted, unique) as arithmetic runs ``(start, stop, step)``."""
    out: list[list[int]] = []  # [start, last + 1, step]
    for r in sorted(set(ranks)):
        if out and out[-1][1] - 1 == out[-1][0]:  # a run of one rank: the next sets its step
            out[-1][1], out[-1][2] = r + 1, r - out[-1][0]
        elif out and r - (out[-1][1] - 1) == out[-1][2]:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1, 1])
    return tuple((a, b, c) for a, b, c in out)


def unrun(spans: Runs) -> tuple[int, ...]:
    """The ranks of ``runs(...)``, sorted."""
    return tuple(r for start, stop, step in spans for r in range(start, stop, step))


def _names(spans: Runs, rank: int) -> bool:
    return any(start <= rank < stop and (rank - start) % step == 0 for start, stop, step in spans)


class _Log:
    """This rank's entries posted, and how far it read each other rank's entries."""

    def __init__(self) -> None:
        self.posted = 0
        self.read: dict[int, int] = {}


_logs: "weakref.WeakKeyDictionary[Any, _Log]" = weakref.WeakKeyDictionary()  # one per default process group


def _log() -> _Log:
    group = dist.group.WORLD
    if group not in _logs:
        _logs[group] = _Log()
    return _logs[group]


def _key(rank: int, index: int, part: str = "entry") -> str:
    return f"{_PREFIX}{rank}/{index}/{part}"


class Meeting:
    """One build's entry on the board and the items of the builds it met (``items``: global rank -> item)."""

    def __init__(self, item: object, named: Iterable[int], what: str, describe: Callable[[object], str]) -> None:
        self.rank, self.what, self.describe = dist.get_rank(), what, describe
        others = sorted(set(named) - {self.rank})
        self.items: dict[int, object] = {self.rank: item}
        self.met: dict[int, int] = {}  # global rank -> index of the entry met
        self.index: Optional[int] = None
        if dist.get_backend() == "fake":  # a fake world's other ranks do not exist
            return
        self.store = default_store()
        self.deadline = time.monotonic() + self.store.timeout.total_seconds()
        log = _log()
        self.index, log.posted = log.posted, log.posted + 1
        self.store.set(_key(self.rank, self.index), pickle.dumps((runs(others), item)))
        self._pair(log, others)

    def _pair(self, log: _Log, waiting: list[int]) -> None:
        """Read each named rank's entries in turn up to the first that names this rank."""
        passed: dict[int, object] = {}
        while waiting:
            keys = [_key(m, log.read.get(m, 0)) for m in waiting]
            try:
                entries = self._posted(keys, waiting, passed)
            except TimeoutError as err:
                self._post(("TimeoutError", str(err)))  # the ranks met so far wait for it
                raise
            for m, entry in zip(list(waiting), entries):
                if entry is None:
                    continue
                named, item = entry
                index, log.read[m] = log.read.get(m, 0), log.read.get(m, 0) + 1
                if _names(named, self.rank):
                    self.met[m], self.items[m] = index, item
                    waiting.remove(m)
                else:
                    passed[m] = item

    def verdicts(self, mine: Optional[tuple[str, str]]) -> dict[int, tuple[str, str]]:
        """Post this rank's outcome (``(error type, message)`` or None) and return the ranks met
        whose outcome was a failure (global rank -> theirs)."""
        if not self.met:  # no rank reads this build's outcome
            return {}
        self._post(mine)
        ranks = sorted(self.met)
        got = self._get([_key(m, self.met[m], "verdict") for m in ranks], ranks, {})
        return {m: v for m, v in zip(ranks, got) if v is not None}

    def _post(self, mine: Optional[tuple[str, str]]) -> None:
        self.store.set(_key(self.rank, self.index, "verdict"), pickle.dumps(mine))

    def _get(self, keys: list[str], ranks: list[int], passed: dict[int, object]) -> list:
        """The values of ``keys`` (posted by ``ranks``) once all are there; TimeoutError at the deadline."""
        self._wait(keys, ranks, passed)
        return [pickle.loads(v) for v in self.store.multi_get(keys)]

    def _posted(self, keys: list[str], ranks: list[int], passed: dict[int, object]) -> list:
        """The values of those of ``keys`` posted (None for the others) once one is; TimeoutError at the deadline."""
        while not self.store.check(keys):
            there = [k for k in keys if self.store.check([k])]
            if there:
                got = dict(zip(there, self.store.multi_get(there)))
                return [pickle.loads(got[k]) if k in got else None for k in keys]
            try:
                self._wait(keys[:1], ranks, passed, keys)
            except TimeoutError:  # a rank may post just after the deadline: name every rank waited for
                self._keep_late_posts(keys, ranks, passed)
                raise TimeoutError(self._late(ranks, passed)) from None
        return [pickle.loads(v) for v in self.store.multi_get(keys)]

    def _keep_late_posts(self, keys: list[str], ranks: list[int], passed: dict[int, object]) -> None:
        """The entries of ``keys`` posted since the deadline, kept as those ranks' last builds."""
        for rank, key in zip(ranks, keys):
            if self.store.check([key]):
                passed[rank] = pickle.loads(self.store.get(key))[1]

    def _wait(self, keys: list[str], ranks: list[int], passed: dict[int, object],
              every: Optional[list[str]] = None) -> None:
        """Wait until ``keys`` are posted; at the deadline, a TimeoutError naming the ranks of
        ``every`` key (``keys`` by default) not posted."""
        left = self.deadline - time.monotonic()
        try:
            self.store.wait(keys, timedelta(seconds=max(left, 0.001)))
        except dist.DistStoreError:
            every = keys if every is None else every
            late = [r for r, k in zip(ranks, every) if not self.store.check([k])]
            raise TimeoutError(self._late(late, passed)) from None

    def _late(self, late: list[int], passed: dict[int, object]) -> str:
        last = "; ".join(f"global rank {r}: {self.describe(passed[r]) if r in passed else 'no build since'}"
                         for r in late)
        return (f"{self.what}: global rank {self.rank} waited {self.store.timeout.total_seconds():.0f} s (the "
                f"default process group's timeout) for global ranks {late}, named by its layout, to build "
                f"a model whose layout names it; their last builds: {last}. Every rank of a layout builds it "
                f"(the same models in the same order)")
