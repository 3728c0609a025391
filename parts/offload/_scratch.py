"""Scratch directories of ``DiskStore``: owned, removed on SIGTERM, reclaimed once their owner is gone.

Each store directory (``parts-store-*``) holds an ``owner.json``: host name, pid, the
process's start time (``/proc/<pid>/stat``, so a reused pid is not taken for the owner), its
pid namespace and the boot id. A new store scans its parent path and removes the directories
whose owner on this host is gone (a rank killed by SIGKILL, a crash in native code, a
reboot), saying how much it freed; a directory of another host (a shared file system), of
another pid namespace (another container: its pids mean nothing here) or without an owner
record is left alone.

SIGTERM (what ``kill``, ``timeout``, Slurm and Kubernetes send) would end the process without
running exit handlers. A handler installed before the first store's directory is made removes
every live store's directory, then does what the signal did before: under the default disposition the process
is terminated by SIGTERM again; an earlier Python handler is called instead (it may save a
checkpoint from the store, so the directories stay until the process exits normally, which
removes them); an ignored SIGTERM stays ignored. Python runs signal handlers on the main
thread between bytecodes: a process blocked inside a native call (a hung collective) handles
it when the call returns; SIGKILL leaves the directory, for the next store to reclaim. A
directory is the handler's from the moment it exists: a SIGTERM while it is being made (its
owner record written, dead owners' directories reclaimed, which may take seconds) removes it
too; one arriving between ``mkdtemp`` and the directory's registration is held until that is
done (on the main thread, where the handler runs).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import weakref
from typing import Any, Callable, Optional

from parts.base import owner_records as owner

OWNER_FILE = "owner.json"
PREFIX = "parts-store-"
logger = logging.getLogger("parts.offload")

_live: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()  # id -> finalizer holder
_installed: dict[str, Any] = {}  # "pid" of the process whose handler is in place, "previous" handler


def write_owner(directory: str) -> None:
    """Record this process as the owner of ``directory``."""
    with open(os.path.join(directory, OWNER_FILE), "w") as f:
        json.dump(owner.record(), f)


def _owner_gone(directory: str, here: dict[str, Optional[str]]) -> bool:
    """True if ``directory``'s recorded owner is a process of this host that no longer runs."""
    try:
        with open(os.path.join(directory, OWNER_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return False  # no (readable) record: not ours to judge
    return owner.gone(record, here)


def make_dir(path: str) -> "Watch":
    """A fresh private directory under ``path`` (created if missing) recording its owner, removed on
    SIGTERM from the moment it exists (module docstring); a clear error if impossible."""
    _install()
    try:
        os.makedirs(path, exist_ok=True)
        holder = _create(path)
    except OSError as e:
        raise _unwritable(path, e) from e
    try:
        write_owner(holder.directory)
    except OSError as e:
        remove_tree(holder.directory)
        raise _unwritable(path, e) from e
    return holder


def _unwritable(path: str, e: OSError) -> PermissionError:
    return PermissionError(f"DiskStore: cannot create scratch files under {path!r} "
                           f"({e.strerror or e}); pass a writable directory")


def _create(path: str) -> "Watch":
    """``mkdtemp`` and the directory's registration for the handler, a SIGTERM between them held
    until both are done (on the main thread, where the handler runs)."""
    holding = threading.current_thread() is threading.main_thread()
    _installed["creating"] = holding
    try:
        holder = Watch(tempfile.mkdtemp(prefix=PREFIX, dir=path))
        _live[id(holder)] = holder
        return holder
    finally:
        _installed["creating"] = False
        if holding and _installed.pop("held", None) is not None:
            _on_sigterm(signal.SIGTERM, None)


def directory_bytes(directory: str) -> int:
    """Bytes the files under ``directory`` take on disk."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            total += max(st.st_size, getattr(st, "st_blocks", 0) * 512)
    return total


def reclaim(path: str, keep: str) -> int:
    """Remove the store directories under ``path`` (not ``keep``) whose owner is gone; the bytes freed."""
    here, freed, count = owner.here(), 0, 0
    try:
        names = [n for n in os.listdir(path) if n.startswith(PREFIX)]
    except OSError:
        return 0
    for name in names:
        directory = os.path.join(path, name)
        if directory == keep or not os.path.isdir(directory) or not _owner_gone(directory, here):
            continue
        size = directory_bytes(directory)
        shutil.rmtree(directory, ignore_errors=True)
        if not os.path.exists(directory):
            freed, count = freed + size, count + 1
    if count:
        logger.warning("DiskStore: reclaimed %.1f MiB in %d scratch director%s under %s left by "
                       "processes that are gone", freed / 2**20, count, "y" if count == 1 else "ies", path)
    return freed


def remove_tree(directory: str, tries: int = 1000) -> None:
    """Remove ``directory`` until it is gone: an IO thread may create a file in it while ``rmtree``
    runs (its removal then fails, not empty), but none can once the directory itself is gone (no
    thread creates directories)."""
    for _ in range(tries):
        shutil.rmtree(directory, ignore_errors=True)
        if not os.path.lexists(directory):
            return


def _on_sigterm(signum: int, frame: Any) -> None:
    """Remove the live stores' directories, then do what SIGTERM did before (module docstring)."""
    if _installed.get("creating"):
        _installed["held"] = signum  # a directory is being made: handled once it is registered
        return
    previous = _installed.get("previous")
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    for finalizer in list(_live.values()):
        finalizer.remove_now()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


class Watch:
    """A live store's directory for the SIGTERM handler: ``remove_now`` removes it (this process's only)."""

    def __init__(self, directory: str) -> None:
        self.directory, self.pid = directory, os.getpid()

    def remove_now(self) -> None:
        """Remove the directory if this process created it."""
        if os.getpid() == self.pid:
            remove_tree(self.directory)


def _install() -> None:
    """Put the SIGTERM handler in place once per process, from the main thread (elsewhere nothing)."""
    if _installed.get("pid") != os.getpid() and threading.current_thread() is threading.main_thread():
        current: Callable | int | None = signal.getsignal(signal.SIGTERM)
        if current is not _on_sigterm:
            _installed["previous"] = current
            signal.signal(signal.SIGTERM, _on_sigterm)
        _installed["pid"] = os.getpid()
