"""Reading a saved ``BF16Optimizer`` checkpoint: any element range of a parameter's master or state.

A ``Reader`` takes a consolidated dict or the per-rank dicts of any saved world size and
returns elements ``[e0, e1)`` of one parameter's flat master or state tensor, stitched from
the saved ranks that held them (``layout.source_ranges``); it checks names, shapes, dtypes
and which saved ranks a load needs before anything is loaded.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

import torch

from .layout import source_ranges
from .load_checks import check_dtypes, check_names

FORMAT = "parts.optim.BF16Optimizer/1"
Source = Union[Mapping[str, Any], Sequence[Mapping[str, Any]]]  # consolidated, or every rank's


class Reader:
    """Reads elements ``[e0, e1)`` of one saved parameter's flat master or state."""

    def __init__(self, source: Optional[Source]) -> None:
        if source is None:
            raise ValueError("BF16Optimizer.load_state_dict got None on this rank: "
                             "consolidated_state_dict() returns None on every rank but 0 (it gathers "
                             "to rank 0); pass the same consolidated dict on every rank (save it on "
                             "rank 0, load the file on every rank), or every saved rank's state_dict()")
        sds = list(source) if isinstance(source, (list, tuple)) else [source]
        for sd in sds:
            if not isinstance(sd, dict) or sd.get("format") != FORMAT:
                raise ValueError("BF16Optimizer.load_state_dict expects BF16Optimizer.state_dict() "
                                 "output (a list of every rank's) or consolidated_state_dict()")
        self.first = sds[0]
        self.consolidated = self.first["kind"] == "consolidated"
        self.sds = {d.get("rank", 0): d for d in sds}  # only the saved ranks this rank reads
        self.meta = {m["name"]: m for m in self.first["params"]}

    def check(self, model: dict[str, Sequence[int]], strict: bool) -> None:
        """Raise before loading if names, shapes or dtypes do not fit ``model`` (name -> shape)."""
        check_names({n: m["shape"] for n, m in self.meta.items()}, model, strict)
        check_dtypes(self.sds.values())

    def _span(self, name: str) -> tuple[int, int]:
        """(offset of ``name`` in its saved partition space, saved partition size)."""
        m = self.meta[name]
        if m["kind"] == "flat":
            return m["offset"], self.first["groups"][m["group"]]["partition_numel"]
        return 0, m["shard_numel"]

    def check_sources(self, pieces: Sequence[tuple[str, int, int]]) -> None:
        """Raise naming the saved ranks whose dicts the ``(name, e0, e1)`` pieces need and lack."""
        if self.consolidated:
            return
        need = set()
        for name, e0, e1 in pieces:
            if e1 > e0:
                base, size = self._span(name)
                need.update(rank for rank, _, _ in source_ranges(base + e0, base + e1, size))
        lacking = sorted(need - set(self.sds))
        if lacking:
            plural = "s" if len(lacking) > 1 else ""
            raise ValueError(f"BF16Optimizer.load_state_dict: this rank's partition needs the state "
                             f"dict{plural} of saved rank{plural} {', '.join(map(str, lacking))} of "
                             f"{self.first['world_size']}; got saved ranks {sorted(self.sds)}. Pass "
                             f"the list of every saved rank's state_dict() on every rank")

    def _record(self, name: str, rank: int) -> dict:
        if rank not in self.sds:
            raise ValueError(f"loading parameter {name!r} needs the state dict of saved rank "
                             f"{rank} of {self.first['world_size']}; got ranks {sorted(self.sds)}")
        m = self.meta[name]
        if m["kind"] == "flat":
            return self.sds[rank]["groups"][m["group"]]
        return self.sds[rank]["sharded"][m["group"]][m["slot"]]

    def read(self, name: str, key: Optional[str], e0: int, e1: int) -> torch.Tensor:
        """Elements ``[e0, e1)`` of the master (``key`` None) or state ``key`` of ``name``."""
        if self.consolidated:
            src = self.first["master"][name] if key is None else self.first["state"][name][key]
            return src.reshape(-1)[e0:e1]
        base, size = self._span(name)
        parts = []
        for rank, lo, hi in source_ranges(base + e0, base + e1, size):
            rec = self._record(name, rank)
            parts.append((rec["master"] if key is None else rec["state"][key])[lo:hi])
        return torch.cat(parts) if len(parts) != 1 else parts[0]

    def keys(self, name: str) -> tuple[list[str], dict]:
        """(per-element state keys, other state) saved for ``name``."""
        if self.consolidated:
            return list(self.first["state"][name]), self.first["scalars"][name]
        rec = self._record(name, self.first["rank"])
        return list(rec["state"]), rec["scalars"]
