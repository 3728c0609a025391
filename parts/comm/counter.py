"""The byte counter of every collective ``parts`` issues, with one convention.

A collective over ``w`` ranks on chunks of ``c`` bytes each (all-gather: each rank's shard;
reduce-scatter: each rank's piece of the result) counts ``(w - 1) * c``: what this rank
receives in an all-gather and sends in a reduce-scatter, the same for every algorithm
(ring, one broadcast per rank, direct exchange). An all-reduce of ``n`` bytes counts
``2 * (w - 1) / w * n`` rounded down (a reduce-scatter and an all-gather); a broadcast
counts its ``n`` bytes on every rank but a world of one; an all-to-all counts the bytes this rank
sends to the other ranks; a ``check`` (``same_everywhere``: a 16-byte all-reduce that only compares a
value across ranks) counts like an all-reduce under its own kind, apart from the traffic of the model.
A world of one moves nothing and
counts 0 bytes; calls are counted anyway.

The counter is process-wide, like torch's own allocator statistics: it observes, it
configures nothing, and a test or benchmark reads differences of two ``snapshot()``s.

Beside the totals it keeps a ledger per process group (``by_group()``): the same bytes and
calls, keyed by the group's global ranks as a string (``"0,1"``; ``"local"`` for a world of
one) and the kind, so a hybrid layout shows what crossed which group (on a cluster, which
bytes left the node). The totals are the sums of the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass


def wire_bytes(chunk_bytes: int, world_size: int) -> int:
    """Bytes one rank moves in an all-gather or reduce-scatter of ``chunk_bytes`` per rank."""
    return (world_size - 1) * chunk_bytes


@dataclass
class CommCounter:
    """Bytes (module docstring's convention) and calls of the collectives of this process."""

    allgather_bytes: int = 0
    allgather_calls: int = 0
    reduce_scatter_bytes: int = 0
    reduce_scatter_calls: int = 0
    all_reduce_bytes: int = 0
    all_reduce_calls: int = 0
    broadcast_bytes: int = 0
    broadcast_calls: int = 0
    all_to_all_bytes: int = 0
    all_to_all_calls: int = 0
    check_bytes: int = 0
    check_calls: int = 0

    def add(self, kind: str, nbytes: int, calls: int = 1, group: str = "local") -> None:
        """Count ``calls`` collectives of ``kind`` ("allgather", "reduce_scatter", ...) moving
        ``nbytes`` over ``group`` (its ledger key: see ``group_key``)."""
        setattr(self, f"{kind}_bytes", getattr(self, f"{kind}_bytes") + nbytes)
        setattr(self, f"{kind}_calls", getattr(self, f"{kind}_calls") + calls)
        row = self._ledger().setdefault(group, {})
        row[f"{kind}_bytes"] = row.get(f"{kind}_bytes", 0) + nbytes
        row[f"{kind}_calls"] = row.get(f"{kind}_calls", 0) + calls

    def _ledger(self) -> dict[str, dict[str, int]]:
        ledger = self.__dict__.get("_groups")
        if ledger is None:
            ledger = self.__dict__["_groups"] = {}
        return ledger

    def by_group(self) -> dict[str, dict[str, int]]:
        """Bytes and calls per group and kind: ``{"0,1": {"allgather_bytes": ..., ...}, ...}``
        (a copy; the keys are the members' global ranks)."""
        return {g: dict(row) for g, row in self._ledger().items()}

    def reset(self) -> None:
        """Zero every counter (e.g. at the start of a step), the ledger per group too."""
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)
        self._ledger().clear()

    def snapshot(self) -> dict[str, int]:
        """The counters as a plain dict."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def ledger_since(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """``after - before`` of two ``by_group()`` ledgers (groups and kinds that moved nothing left out)."""
    out: dict[str, dict[str, int]] = {}
    for group, row in after.items():
        old = before.get(group, {})
        diff = {k: v - old.get(k, 0) for k, v in row.items() if v != old.get(k, 0)}
        if diff:
            out[group] = diff
    return out


comm_counter = CommCounter()
"""The counter of this process (see the module docstring for what a byte is)."""
