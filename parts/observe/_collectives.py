"""The collectives of parts.observe: this process's rank for rank-0-only reports."""

from __future__ import annotations

from parts.comm import GroupArg, group_info


def rank(group: GroupArg = None) -> int:
    """This process's rank in ``group`` (default group), 0 when not distributed."""
    return group_info(group, "parts.observe").rank
