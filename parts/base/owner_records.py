"""Owner records of files a process may leave behind: which process made them, and whether it is gone.

A record names the host, the pid namespace, the boot id, the pid and the process's start time
(``/proc/<pid>/stat``, so a reused pid is not taken for the owner). An owner is gone only when
the record is of this host and pid namespace and its process no longer runs (or is a zombie,
or a new process holds its pid), or the machine rebooted since; a record of another host or
container, or an unreadable one, is never judged gone. ``DiskStore``'s scratch directories
and the host-memory snapshots of ``parts.comm.Snapshots`` are reclaimed by it.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Optional


def start_time(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (clock ticks since boot), "zombie", or None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    if fields and fields[0] == "Z":  # a zombie: dead, not reaped yet
        return "zombie"
    return fields[19] if len(fields) > 19 else None


def _read(path: str, link: bool = False) -> Optional[str]:
    """The text (or link target) at ``path``, or None where there is none."""
    try:
        if link:
            return os.readlink(path)
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def here() -> dict[str, Optional[str]]:
    """This host, pid namespace and boot."""
    return {"host": socket.gethostname(), "pidns": _read("/proc/self/ns/pid", link=True),
            "boot": _read("/proc/sys/kernel/random/boot_id")}


def record(pid: Optional[int] = None) -> dict[str, Any]:
    """The owner record of process ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    return {**here(), "pid": pid, "start": start_time(pid)}


def gone(owner: Any, where: Optional[dict[str, Optional[str]]] = None) -> bool:
    """True if ``owner`` (a record) is a process of this host that no longer runs."""
    where = here() if where is None else where
    try:
        pid, start = int(owner["pid"]), owner.get("start")
    except (ValueError, KeyError, TypeError, AttributeError):
        return False  # not a record: not ours to judge
    if owner.get("host") != where["host"] or owner.get("pidns") != where["pidns"] or pid == os.getpid():
        return False
    if where["boot"] is not None and owner.get("boot") not in (None, where["boot"]):
        return True  # the machine rebooted since
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    now = start_time(pid)
    return now == "zombie" or (start is not None and now is not None and now != start)
