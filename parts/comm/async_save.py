"""``parts.comm.dcp.async_save``: a checkpoint save that returns once this rank's state is in
host memory, and writes and commits it in a background thread.

On the calling thread, every rank:
- waits for its previous async save, raising that save's error if it failed;
- copies its state dict into host buffers (``parts.comm.host_copy.HostCopy``: CPU tensors,
  reused from save to save, so a rank holds at most one copy beyond its training state);
- runs DCP's planning step with the other ranks (agreed, as ``dcp.save``'s), and rank 0 makes
  the save's staging folder.

In the background thread, each rank writes its own files into the staging folder, fsyncs
and hashes them: local file IO, no collective (gloo would pair one with the training loop's).
The ranks then report to rank 0 through the default store (``parts.comm.store_gather``); rank 0
writes DCP's metadata and the manifest, verifies and commits the transaction
(``parts.comm.dcp_files``) and posts the verdict, which every rank reads. Until that commit the
previous checkpoint at the path stays whole: a process killed during the write leaves only
the staging folder, which the next save or load of the path clears.

Errors are never dropped: ``wait()`` (or ``result()``) raises the save's ``CheckpointError``
(the same on every rank, naming the failing ranks), the next ``async_save`` raises it before it
copies anything, and a script that ends without waiting waits at exit; a save that failed
there is reported on stderr and the process exits 1.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional

import torch.distributed.checkpoint as torch_dcp

from parts.base.files import CheckpointError
from parts.comm import dcp_steps as steps
from parts.comm import dcp_files as files
from parts.comm.exit import _failing
from parts.comm.failure import Failure, attempt, failures_in
from parts.comm.group import GroupArg
from parts.comm.host_copy import HostCopy
from parts.comm.shard_view import settle
from parts.comm.store_gather import StoreGather


class AsyncSave:
    """A save running in the background: ``wait()`` / ``result()`` return its DCP ``Metadata``
    once it is committed, or raise its ``CheckpointError``; ``done()`` says whether it ended."""

    def __init__(self, where: Any) -> None:
        self.where = where
        self._finished = threading.Event()
        self._metadata: Optional[torch_dcp.Metadata] = None
        self._error: Optional[BaseException] = None
        self.waited = False

    def done(self) -> bool:
        """True once the save is committed or has failed."""
        return self._finished.is_set()

    def wait(self, timeout: Optional[float] = None) -> torch_dcp.Metadata:
        """Block until the save ends; its metadata, or its ``CheckpointError`` raised (every call)."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"parts.comm.dcp.async_save of {self.where}: not finished after {timeout} s")
        self.waited = True
        if self._error is not None:
            raise self._error
        return self._metadata

    result = wait

    def _end(self, metadata: Optional[torch_dcp.Metadata], error: Optional[BaseException]) -> None:
        self._metadata, self._error = metadata, error
        self._finished.set()


class _Process:
    """This process's host copy and its pending save: one of each, whatever the caller."""

    host = HostCopy()
    pending: Optional[AsyncSave] = None
    exit_hook = False


def async_save(state_dict: dict[str, Any], *, checkpoint_id: Any = None,
               storage_writer: Optional[torch_dcp.StorageWriter] = None,
               planner: Optional[torch_dcp.SavePlanner] = None, group: GroupArg = None) -> AsyncSave:
    """``dcp.save`` that returns once ``state_dict`` is copied to host memory; the write and the
    commit run in a background thread (see the module docstring).

    A second ``async_save`` (of any checkpoint) waits for the previous one to end and raises its
    error if it failed; the host buffers of one save are reused by the next. Collective: every
    rank of ``group`` calls it. The checkpoint's files are those ``dcp.save`` writes."""
    _check_previous()
    if checkpoint_id is None and storage_writer is None:
        raise ValueError("parts.comm.dcp.async_save: give checkpoint_id (a directory) or a storage_writer")
    target = steps.target(checkpoint_id, storage_writer, torch_dcp.FileSystemWriter)
    ranks = steps.Ranks(group, "async save", target if target is not None else checkpoint_id)
    staging, token = ranks.on_coordinator(
        "prepare", lambda: (files.begin(target) if target is not None else None, uuid.uuid4().hex))
    staged = (staging, target) if target is not None else None
    try:
        writer = steps.writer(storage_writer, staging if staged else checkpoint_id, False)
        planner, plans, metadata = steps.plan_save(lambda: _Process.host.take(steps.plain(state_dict)), ranks,
                                                 writer, planner)
    except Exception:
        if staged and ranks.is_coordinator:  # the step was agreed: every rank is past it
            files.abandon(staging)
        _reset(storage_writer, target)
        raise
    finally:
        settle(state_dict)
    save = AsyncSave(ranks.where)
    gather = StoreGather(f"parts/async_save/{token}", ranks.info)
    thread = threading.Thread(target=_background, name="parts-async-save", daemon=True,
                              args=(save, ranks, gather, writer, planner, plans[ranks.rank], metadata, staged,
                                    storage_writer))
    _Process.pending = save
    _exit_hook()
    thread.start()
    return save


def _check_previous() -> None:
    """Wait for this process's previous async save; raise its error if it failed and no
    ``wait()`` raised it already."""
    previous, _Process.pending = _Process.pending, None
    if previous is not None and not previous.waited:
        previous.wait()


def _reset(storage_writer: Optional[torch_dcp.StorageWriter], target: Optional[Path]) -> None:
    if storage_writer is not None and target is not None:
        storage_writer.reset(target)  # the writer names the checkpoint, not its staging


def _background(save: AsyncSave, ranks: Any, gather: StoreGather, writer: torch_dcp.StorageWriter,
                planner: torch_dcp.SavePlanner, plan: Any, metadata: Optional[torch_dcp.Metadata],
                staged: Optional[tuple[Path, Path]], storage_writer: Optional[torch_dcp.StorageWriter]) -> None:
    """The thread: this rank's files, then rank 0's commit; the verdict ends ``save`` on every rank."""
    try:
        mine = attempt(lambda: steps.write_local(writer, planner, plan, staged, ranks.rank), ranks.rank)[0]
        verdict = gather.gather_decide(mine, lambda every: _commit(ranks, writer, metadata, every, staged))
        save._end(*_outcome(ranks, verdict))
    except BaseException as exc:  # noqa: BLE001 - the store failed: the save ends in error, not silently
        save._end(None, CheckpointError(f"checkpoint async save of {ranks.where} failed on rank {ranks.rank} "
                                        f"waiting for the other ranks: {type(exc).__name__}: {exc}",
                                        path=ranks.where, failures={ranks.rank: f"{type(exc).__name__}: {exc}"}))
    finally:
        _reset(storage_writer, staged[1] if staged else None)


def _commit(ranks: Any, writer: torch_dcp.StorageWriter, metadata: torch_dcp.Metadata, every: list,
            staged: Optional[tuple[Path, Path]]) -> Any:
    """Rank 0: the failures every rank reported (the staging folder removed), or the committed metadata."""
    failed = failures_in(every)
    if failed:
        if staged:
            files.abandon(staged[0])
        return ("write", failed)
    try:
        return steps.finish_save(writer, metadata, every, staged)
    except Exception:
        if staged:
            files.abandon(staged[0])
        raise


def _outcome(ranks: Any, verdict: Any) -> tuple[Optional[torch_dcp.Metadata], Optional[BaseException]]:
    """(metadata, None) for a committed save, (None, the error every rank raises) for a failed one."""
    if isinstance(verdict, Failure):
        return None, ranks.error("commit")({0: verdict})
    if isinstance(verdict, tuple) and len(verdict) == 2 and isinstance(verdict[1], Mapping):
        return None, ranks.error(verdict[0])(verdict[1])
    return verdict, None


def _exit_hook() -> None:
    """At the first async save: wait for the pending save at a normal exit (registered after
    ``parts.comm.exit``'s hook, so it runs before the process groups end)."""
    if not _Process.exit_hook:
        atexit.register(_wait_at_exit)
        _Process.exit_hook = True


def _wait_at_exit() -> None:
    save = _Process.pending
    if save is None or save.waited:
        return
    if _failing() and not save.done():
        print(f"parts.comm.dcp.async_save: the process ends on an exception while the save of {save.where} "
              f"is unfinished; it is not committed (the checkpoint there is the previous one)",
              file=sys.stderr, flush=True)
        return
    try:
        save.wait()
    except Exception as exc:  # noqa: BLE001 - reported, and the exit status says so
        print(f"parts.comm.dcp.async_save: the save of {save.where} failed and nobody waited for it:\n{exc}",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
