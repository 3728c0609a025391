"""``Timers`` with ``log``: each timer's min/max over the ranks of a group, printed on rank 0."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from parts.base import timers as base
from parts.comm import GroupArg, group_info, min_max


def log_timers(timers: base.Timers, names: Optional[Iterable[str]] = None, normalizer: float = 1.0,
               reset: bool = True, group: GroupArg = None,
               printer: Callable[[str], None] = print) -> dict[str, tuple[float, float]]:
    """Min/max over ``group`` of each timer's seconds / ``normalizer``; rank 0 prints them in ms.

    Every rank of ``group`` must call this with the same ``names`` (it is a collective
    when torch.distributed is initialised); a name a rank never started counts as 0 s.
    """
    if normalizer <= 0:
        raise ValueError(f"Timers.log: normalizer must be > 0, got {normalizer}")
    local = timers.elapsed(names, reset=reset)
    lo, hi = min_max(torch.tensor(list(local.values()), dtype=torch.float64, device="cpu"), group)
    result = {n: (lo[i].item() / normalizer, hi[i].item() / normalizer) for i, n in enumerate(local)}
    if group_info(group, "Timers.log").rank == 0 and result:
        printer("time (ms) min/max | " + " | ".join(
            f"{n}: {a * 1e3:.2f}/{b * 1e3:.2f}" for n, (a, b) in result.items()))
    return result


class Timers(base.Timers):
    """``parts.base.Timers`` plus ``log``, the min/max of each timer across ranks."""

    def log(self, names: Optional[Iterable[str]] = None, normalizer: float = 1.0,
            reset: bool = True, group: GroupArg = None,
            printer: Callable[[str], None] = print) -> dict[str, tuple[float, float]]:
        """``log_timers(self, ...)``: a collective over ``group``; rank 0 prints."""
        return log_timers(self, names, normalizer, reset, group, printer)
