"""Every rank's value to group rank 0, and rank 0's verdict back, through the default store.

A thread that runs beside the training loop must not issue collectives: gloo pairs the
collectives of a group in the order each rank issues them, so one from a background thread
would pair with the loop's. The default process group's key-value store is reached by every
rank already and orders nothing: ``StoreGather`` posts each rank's pickled value under a key
of its own (named by a token the ranks agreed on beforehand), group rank 0 waits for all of
them, decides, and posts the verdict that every rank reads. The thread uses its own clone of
the store client, so its blocking waits do not hold up the store calls of other threads.
Keys are removed once every rank has read the verdict.

A rank that never posts (killed) leaves rank 0 waiting for the store's timeout (the process
group's); rank 0 then posts a verdict naming the missing ranks.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

from parts._compat import default_store
from parts.comm.failure import Failure, attempt
from parts.comm.group import GroupInfo


class StoreGather:
    """One exchange of ``gather_decide``: values in, rank 0's verdict out, under ``prefix``."""

    def __init__(self, prefix: str, info: GroupInfo) -> None:
        self.rank, self.world_size, self.info = info.rank, info.world_size, info
        self.base = f"{prefix}/"
        self.store = default_store().clone() if info.world_size > 1 else None

    def _key(self, rank: int) -> str:
        return f"{self.base}rank{rank}"

    def gather_decide(self, mine: Any, decide: Callable[[list], Any]) -> Any:
        """``decide(every rank's value)`` run on rank 0 (a ``Failure`` if it raised), on every rank."""
        if self.store is None:
            return attempt(lambda: decide([mine]), 0)[0]
        self.store.set(self._key(self.rank), pickle.dumps(mine, protocol=pickle.HIGHEST_PROTOCOL))
        if self.rank == 0:
            verdict = attempt(lambda: decide(self._collect()), 0)[0]
            self.store.set(self.base + "verdict", pickle.dumps(verdict, protocol=pickle.HIGHEST_PROTOCOL))
        else:
            self.store.wait([self.base + "verdict"])
            verdict = pickle.loads(self.store.get(self.base + "verdict"))
        if self.store.add(self.base + "read", 1) == self.world_size:
            self.store.delete_key(self.base + "verdict")
            self.store.delete_key(self.base + "read")
        return verdict

    def _collect(self) -> list:
        """Every rank's posted value (rank 0): a rank that did not post within the store's
        timeout is a ``Failure`` naming it."""
        keys = [self._key(r) for r in range(self.world_size)]
        try:
            self.store.wait(keys)
        except Exception as exc:  # noqa: BLE001 - the store's timeout: name who is missing
            missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
            if not missing:
                raise
            for r in set(range(self.world_size)) - set(missing):
                self.store.delete_key(keys[r])
            ranks = self.info.global_ranks()
            return [Failure(r, f"TimeoutError: group rank {r} (global rank {ranks[r]}) did not report "
                               f"within the store's timeout ({type(exc).__name__})", "")
                    if r in missing else None for r in range(self.world_size)]
        every = [pickle.loads(value) for value in self.store.multi_get(keys)]
        for key in keys:
            self.store.delete_key(key)
        return every
