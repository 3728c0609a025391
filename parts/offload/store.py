"""``DiskStore``: one rank's scratch store of tensors in files, with asynchronous IO.

Each key is one file in a private scratch directory (``parts-store-*`` under ``path``),
removed on ``close()``, when the store is garbage collected, at interpreter exit and on
SIGTERM; the directory records its owner, and a new store under the same ``path`` reclaims
the directories of owners that are gone (``_scratch``: a rank killed by SIGKILL).
``write``/``read`` split a transfer into pieces of ``block_bytes`` that run on a pool of
``threads`` IO threads (``pread``/``pwrite`` release the GIL), so several pieces are in
the device queue at once; the caller gets an ``IOHandle`` and goes on computing. Queued
reads run before queued writes (``_ioqueue``): a read issued ahead is not held behind
unrelated writes. At most ``max_inflight_bytes`` of submitted transfers are outstanding (a
submit beyond it waits for earlier ones), so the caller's buffers pinned by IO are bounded.
In direct mode a tensor whose memory is ``ALIGN``-aligned (``aligned_empty``; parked
tensors and the optimizer's buffers are) is moved without a copy; only unaligned memory is
copied through a bounce buffer. Memory the store itself holds: one aligned bounce buffer
per IO thread in direct mode, ``ALIGN`` bytes while every transfer is aligned, up to
``block_bytes`` once one is not; nothing in buffered mode; the store never maps its files.
Beside that, ``reuse`` (a ``StoragePool`` of ``parts.base``) keeps up to ``reuse_bytes`` of
the memory of parked tensors it dropped and of grads a step during backward consumed, for the
next load or landing grad of that size (no page faults in the read or the reduce-scatter); of
several blocks of one size the oldest serves first.

Files: a ``rename`` over a key keeps the replaced key's file, already allocated, for the next
new key of its size (a step's staged writes, committed by renames, take the last step's
files): no ``unlink``, ``open`` or ``fallocate`` on the caller's thread per key and step (an
unlink on a file system mounted with ``discard`` costs milliseconds). ``delete`` removes the file.

Ordering: operations on one key run in submission order (a read after a write returns the
written bytes; a read after a failed write raises). A write must not have its source
modified until its handle is waited. Errors surface at ``wait()`` of the operation's
handle and again at ``flush()``; a full disk raises ``DiskFullError`` naming the file and
the bytes that did not fit, at submission when the space reservation fails."""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

import torch

from parts.base.storage_pool import StoragePool
from parts.offload import _fileio, _heap, _scratch
from parts.offload._fileio import ALIGN, round_up
from parts.offload._fileio import DiskFullError as DiskFullError  # raised by writes: part of the store
from parts.offload._ioqueue import IOQueue, Op
from parts.offload._stats import Meter, StoreStats
from parts.offload.staging import staging
from parts.offload._budget import store_budget


class IOHandle:
    """A pending store operation: ``wait()`` blocks until it is done and raises its error."""

    def __init__(self, op: Op, store: "DiskStore") -> None:
        self._op, self._store = op, store

    @property
    def done(self) -> bool:
        """True once every piece of the operation has finished."""
        return self._op.finished.is_set()

    def wait(self) -> None:
        """Block until the operation is done; re-raise its error (a full disk, an IO error)."""
        if not self._op.finished.is_set():
            start = time.perf_counter()
            self._op.finished.wait()
            self._store.stats.wait_seconds += time.perf_counter() - start
        if self._op.error is not None:
            self._store._forget(self._op.error)
            raise self._op.error


@dataclass
class _Entry:
    file: str
    nbytes: int
    reserved: int = 0
    last: Optional[Op] = field(default=None, repr=False)


def _named(error: BaseException, key: str, writing: bool) -> BaseException:
    """A read's ``OSError`` with the store key it was reading in its message (writes name their
    file and bytes already)."""
    if writing or not isinstance(error, OSError) or isinstance(error, DiskFullError) or error.errno is None:
        return error
    # OSError(errno, ...) builds the errno's subclass (FileNotFoundError, PermissionError, ...)
    named = OSError(error.errno, f"DiskStore: key {key!r} cannot be read: {error.strerror}")
    named.__cause__ = error
    return named


def _remove_dir(directory: str, pid: int, queue: IOQueue) -> None:
    if os.getpid() == pid:  # a forked child does not own its parent's scratch files
        queue.stop()
        _scratch.remove_tree(directory)


class DiskStore:
    """One rank's scratch store of tensors in files under ``path``; see the module docstring."""

    def __init__(self, path: str, *, threads: int = 4, max_inflight_bytes: Optional[int] = None,
                 block_bytes: int = 8 << 20, direct: Optional[bool] = None, reuse_bytes: Optional[int] = None,
                 memory_budget: Optional[int] = None) -> None:
        if threads < 1 or (max_inflight_bytes is not None and max_inflight_bytes < 1):
            raise ValueError(f"DiskStore: threads and max_inflight_bytes must be >= 1, got "
                             f"{threads} and {max_inflight_bytes}")
        if block_bytes < ALIGN or block_bytes % ALIGN:
            raise ValueError(f"DiskStore: block_bytes must be a positive multiple of {ALIGN}, got {block_bytes}")
        self.budget = store_budget(memory_budget, threads, block_bytes)  # sizes the windows not given
        if memory_budget is not None:
            block_bytes = self.budget.block_bytes
        max_inflight_bytes = self.budget.max_inflight_bytes if max_inflight_bytes is None else max_inflight_bytes
        _heap.bound_heap()  # freed transfer buffers leave the process: the memory bound holds
        reuse = StoragePool(self.budget.reuse_bytes if reuse_bytes is None else reuse_bytes, newest_first=False)
        self.path = os.path.abspath(os.fspath(path))
        self._watch = _scratch.make_dir(self.path)  # removed on SIGTERM from the moment it exists
        self.directory = self._watch.directory
        self.reclaimed_bytes = _scratch.reclaim(self.path, keep=self.directory)  # left by dead owners
        self._queue = IOQueue(threads, "parts-offload")
        self._finalizer = weakref.finalize(self, _remove_dir, self.directory, os.getpid(), self._queue)
        can = _fileio.probe_direct(self.directory)
        if direct and not can:
            self._finalizer()
            raise ValueError(f"DiskStore: direct IO (O_DIRECT) was asked for but the file system "
                             f"of {self.path!r} refuses it; pass direct=None to fall back")
        self.direct = can if direct is None else bool(direct)
        self._uncache = weakref.finalize(self, _heap.cache_blocks(self.budget.host_cache_bytes))  # reuse, while open
        self.threads, self.block_bytes, self.max_inflight_bytes = threads, block_bytes, max_inflight_bytes
        self.stats = StoreStats()
        self.reuse = reuse  # memory of dropped parked tensors, for their next loads
        self._meter = Meter(self.stats)
        self._index: dict[str, _Entry] = {}
        self._files = 0  # files ever created (a deleted key's name is never reused)
        self._spare_files: dict[int, list[tuple[str, Optional[Op]]]] = {}  # reserved bytes -> (file, last op)
        self._lock = threading.Condition()
        self._inflight_bytes = 0
        self._errors: list[BaseException] = []
        self._local = threading.local()
        self._open = True
        self._owners: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()

    # ------------------------------------------------------------------ public API
    def claim(self, prefix: str, owner: Any) -> None:
        """Reserve the keys under ``prefix`` for ``owner`` while it lives: two owners of one
        prefix would overwrite each other's tensors without a sound."""
        holder = self._owners.get(prefix)
        if holder is not None and holder is not owner:
            raise ValueError(f"DiskStore {self.path!r}: key prefix {prefix!r} belongs to a live "
                             f"{type(holder).__name__}; give this {type(owner).__name__} another "
                             f"prefix= (or drop the other one first)")
        self._owners[prefix] = owner

    def write(self, key: str, tensor: torch.Tensor) -> IOHandle:
        """Store ``tensor``'s bytes under ``key`` (replacing them); keep ``tensor`` unchanged until waited."""
        self._check_open("write")
        src = _fileio.bytes_of(tensor, f"write of key {key!r}")
        entry = self._index.get(key)
        if entry is None:
            entry = self._index[key] = self._new_entry(src.numel())
        self._reserve(entry, src.numel())
        entry.nbytes = src.numel()
        return self._submit(entry, key, src, writing=True, fence=staging.fence(tensor))

    def read(self, key: str, out: torch.Tensor, urgent: bool = False) -> IOHandle:
        """Fill ``out`` (contiguous, CPU, exactly the stored byte size) with the bytes stored under
        ``key``; ``urgent`` reads (compute will wait for them) go before other queued reads."""
        self._check_open("read")
        entry = self._index.get(key)
        if entry is None:
            raise KeyError(f"DiskStore {self.directory!r}: no key {key!r}")
        dst = _fileio.bytes_of(out, f"read of key {key!r}")
        if dst.numel() != entry.nbytes:
            raise ValueError(f"DiskStore: key {key!r} holds {entry.nbytes} bytes, the output tensor "
                             f"{tuple(out.shape)} {out.dtype} has {dst.numel()}")
        return self._submit(entry, key, dst, writing=False, urgent=urgent)

    def delete(self, key: str) -> None:
        """Forget ``key`` and remove its file (after its pending operations)."""
        entry = self._index.pop(key, None)
        if entry is not None:
            self._unlink(entry)

    def rename(self, src: str, dst: str) -> None:
        """Make ``src``'s bytes (and its pending operations) those of ``dst``, replacing what ``dst``
        held; ``src`` is gone. No bytes move: a write staged under ``src`` is committed to ``dst``."""
        entry = self._index.pop(src, None)
        if entry is None:
            raise KeyError(f"DiskStore {self.directory!r}: no key {src!r} to rename to {dst!r}")
        old = self._index.get(dst)
        self._index[dst] = entry
        if old is not None:  # its file serves the next new key of its size (its pending ops first)
            self._spare_files.setdefault(old.reserved, []).append((old.file, old.last))

    def _new_entry(self, nbytes: int) -> _Entry:
        """A new key's entry: a spare file of exactly the space ``nbytes`` needs if there is one
        (ordered after that file's last operation), else a new file."""
        spares = self._spare_files.get(round_up(nbytes) if self.direct else nbytes)
        if spares:
            file, last = spares.pop()
            return _Entry(file, 0, round_up(nbytes) if self.direct else nbytes, last)
        self._files += 1
        return _Entry(f"{self._files:08d}.bin", 0)

    def _unlink(self, entry: _Entry) -> None:
        """Remove ``entry``'s file once its pending operations finished."""
        if entry.last is not None:
            entry.last.finished.wait()
        try:
            os.unlink(os.path.join(self.directory, entry.file))
        except FileNotFoundError:
            pass

    def flush(self) -> None:
        """Wait for every pending operation; raise the first error any of them met."""
        for last in self._pending():
            last.finished.wait()
        if self._errors:
            error, self._errors = self._errors[0], []
            raise error

    def close(self) -> None:
        """Wait for pending IO, stop the IO threads and remove the scratch files (idempotent)."""
        if not self._open:
            return
        self._open = False
        for last in self._pending():  # each file's last op finishes after all its others
            last.finished.wait()
        self._index.clear()
        self._spare_files.clear()
        self.reuse.clear()
        self._finalizer()
        self._uncache()
        self._watch = None
        self._queue.join()

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def keys(self) -> list[str]:
        """Stored keys, in first-write order."""
        return list(self._index)

    def nbytes(self, key: str) -> int:
        """Bytes stored under ``key``."""
        if key not in self._index:
            raise KeyError(f"DiskStore {self.directory!r}: no key {key!r}")
        return self._index[key].nbytes

    @property
    def used_bytes(self) -> int:
        """Bytes the store's files take on disk (reservations and spare files included)."""
        spare = sum(size * len(files) for size, files in self._spare_files.items())
        return sum(e.reserved for e in self._index.values()) + spare

    @property
    def closed(self) -> bool:
        """True after ``close()``."""
        return not self._open

    @property
    def mode(self) -> str:
        """How the store moves bytes: direct IO or buffered pread/pwrite."""
        return (f"direct IO (O_DIRECT: {ALIGN}-byte aligned tensors in place, others through "
                f"aligned bounce buffers)" if self.direct else "buffered pread/pwrite (page cache)")

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._index)} keys, {self.used_bytes / 2**20:.1f} MiB"
        return (f"DiskStore({self.directory!r}, {self.mode}, {state}, threads={self.threads}, "
                f"max_inflight_bytes={self.max_inflight_bytes}, block_bytes={self.block_bytes}, "
                f"reuse_bytes={self.reuse.capacity}, memory_budget={self.budget.memory_budget})")

    def __enter__(self) -> "DiskStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- internals
    def _pending(self) -> list[Op]:
        """The last operation of every file (keys' and spare ones) that has one."""
        spare = [last for files in self._spare_files.values() for _, last in files]
        return [op for op in [e.last for e in self._index.values()] + spare if op is not None]

    def _forget(self, error: BaseException) -> None:
        """An error its waiter saw is not raised again by ``flush()``."""
        with self._lock:
            self._errors = [e for e in self._errors if e is not error]

    def _check_open(self, what: str) -> None:
        if not self._open:
            raise RuntimeError(f"DiskStore {self.directory!r}: {what} after close()")

    def _reserve(self, entry: _Entry, nbytes: int) -> None:
        """Reserve the file's space now so a full disk fails at submission, naming the bytes."""
        need = round_up(nbytes) if self.direct else nbytes
        if need <= entry.reserved:
            return
        path = os.path.join(self.directory, entry.file)
        fd = _fileio.open_file(path, False)
        try:
            _fileio.reserve(fd, path, need)
        finally:
            os.close(fd)
        entry.reserved = need

    def _submit(self, entry: _Entry, key: str, data: torch.Tensor, writing: bool,
                urgent: bool = False, fence: Any = None) -> IOHandle:
        n = data.numel()
        starts = list(range(0, n, self.block_bytes))
        op = Op(len(starts), n, key, entry.last, writing, urgent)
        if starts:  # an empty op finishes at once: the next one must wait for the last that moves bytes
            entry.last = op
        self._acquire(n, writing)
        if not starts:
            self._finish(op, writing, None)
            return IOHandle(op, self)
        path = os.path.join(self.directory, entry.file)
        # each piece's view in a list the IO thread empties: once waited, the store holds no view
        self._queue.submit(op, [partial(self._run, op, path, [data[start:start + self.block_bytes]], start, fence)
                                for start in starts])
        return IOHandle(op, self)

    def _acquire(self, n: int, writing: bool) -> None:
        with self._lock:
            start = time.perf_counter()
            while self._inflight_bytes and self._inflight_bytes + n > self.max_inflight_bytes:
                self._lock.wait()
            self._inflight_bytes += n
            now = time.perf_counter()
            self.stats.wait_seconds += now - start  # a caller blocked by the in-flight cap waits too
            self._meter.submitted(writing, now)

    def _run(self, op: Op, path: str, holder: list, offset: int, fence: Any = None) -> None:
        """One piece on an IO thread, after the key's last operation and the copy filling it (``fence``)."""
        piece, writing = holder.pop(), op.writing  # let go before the op is done: then the caller may free it
        with self._lock:
            start = time.perf_counter()
            self._meter.moving(writing, start)
        try:
            if op.after is not None and op.after.error is not None and not writing:
                raise OSError(f"DiskStore: key {op.key!r} cannot be read: its last write failed "
                              f"({op.after.error})")
            if op.error is None:
                if fence is not None:
                    fence.wait()
                self._transfer(path, piece, offset, writing)
        except BaseException as e:  # handed to the waiter, never lost
            op.error = op.error or _named(e, op.key, writing)
        del piece
        self._finish(op, writing, start)

    def _transfer(self, path: str, piece: torch.Tensor, offset: int, writing: bool) -> None:
        scratch = self._scratch if self.direct else None
        fd = _fileio.open_file(path, self.direct, create=writing)
        try:
            bounced = (_fileio.write_bytes if writing else _fileio.read_bytes)(fd, path, piece, offset, scratch)
        finally:
            os.close(fd)
        if bounced:
            with self._lock:
                self.stats.bytes_bounced += bounced

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """This IO thread's aligned bounce buffer, grown to at least ``nbytes`` (at most ``block_bytes``)."""
        buf = getattr(self._local, "bounce", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.bounce = _fileio.aligned_buffer(max(nbytes, ALIGN))
        return buf

    def _finish(self, op: Op, writing: bool, start: Optional[float]) -> None:
        """Account a piece that ended (moving bytes since ``start``; None: an empty op)."""
        with self._lock:
            now = time.perf_counter()
            seconds = 0.0 if start is None else now - start
            if start is not None:
                self._meter.moved(writing, now)
            if writing:
                self.stats.write_seconds += seconds
            else:
                self.stats.read_seconds += seconds
            op.remaining -= 1
            if op.remaining > 0:
                return
            self._inflight_bytes -= op.nbytes
            self._meter.finished(writing, now)
            if op.error is None:
                if writing:
                    self.stats.bytes_written += op.nbytes
                else:
                    self.stats.bytes_read += op.nbytes
            else:
                self._errors.append(op.error)
            self._lock.notify_all()
        self._queue.done(op)
