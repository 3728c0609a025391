"""Positional file IO on raw tensor memory: direct (``O_DIRECT``) or buffered, no numpy.

Direct IO needs the file offset, the length and the memory address aligned to the device
block (``ALIGN`` = 4096 covers 512- and 4096-byte devices). A transfer whose memory starts
``ALIGN``-aligned (``aligned_empty`` makes such tensors) moves its whole blocks straight
from or into that memory and only its last partial block (under ``ALIGN`` bytes) through
an aligned bounce buffer, so the bytes beyond the tensor are never touched; a transfer
from unaligned memory is copied through the bounce buffer whole. Files are padded to
whole blocks with zeros; the true length lives in the store's index. Buffered IO reads and
writes the caller's memory directly. Both loop over short transfers; a write that makes no
progress is a full disk, never a silent short write. ``OPS`` holds the system calls so a test can make them fail.
"""

from __future__ import annotations

import ctypes
import errno
import os
from types import SimpleNamespace
from typing import Callable, Optional

import torch

ALIGN = 4096
ALIGN_MIN = 16 * ALIGN
OPS = SimpleNamespace(pwritev=os.pwritev, preadv=os.preadv, fallocate=getattr(os, "posix_fallocate", None))
"""The system calls used; tests replace an entry to simulate a failing or full device."""

_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


class DiskFullError(OSError):
    """The store's file system could not take the bytes of a write (the message says how many)."""


def round_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


def aligned_buffer(nbytes: int, align: int = ALIGN) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` whose first byte is ``align``-aligned (for direct IO)."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8, device="cpu")
    skip = (-raw.data_ptr()) % align
    return raw[skip:skip + nbytes]


def worth_aligning(nbytes: int) -> bool:
    """True for a tensor of ``nbytes`` that ``aligned_empty`` aligns: at least ``ALIGN_MIN`` bytes, so
    the ``ALIGN`` extra bytes cost at most 1/16 of it (a smaller one is copied, at most 64 KiB)."""
    return nbytes >= ALIGN_MIN


def aligned_empty(numel: int, dtype: torch.dtype,
                  alloc: Optional[Callable[[int, torch.dtype], torch.Tensor]] = None) -> torch.Tensor:
    """A fresh 1-D ``dtype`` tensor of ``numel`` elements from ``alloc(n, dtype)`` (``torch.empty`` by
    default); if ``worth_aligning``, a view starting ``ALIGN``-aligned into one ``ALIGN`` bytes longer,
    which direct IO moves without a copy (unaligned only if the allocator's alignment is not a
    multiple of the element size: never for torch's 64-byte CPU allocations)."""
    itemsize = dtype.itemsize
    extra = -(-ALIGN // itemsize) if worth_aligning(numel * itemsize) else 0
    raw = alloc(numel + extra, dtype) if alloc is not None else torch.empty(numel + extra, dtype=dtype, device="cpu")
    if not extra:
        return raw
    skip = (-raw.data_ptr()) % ALIGN
    start = skip // itemsize if skip % itemsize == 0 else 0
    return raw[start:start + numel]


def is_aligned(t: torch.Tensor) -> bool:
    """True if ``t``'s first byte is ``ALIGN``-aligned (direct IO can use its memory as is)."""
    return t.data_ptr() % ALIGN == 0


def _view(t: torch.Tensor, start: int, length: int) -> memoryview:
    """A writable memoryview of ``length`` bytes of contiguous CPU tensor ``t`` from byte ``start``."""
    return memoryview((ctypes.c_char * length).from_address(t.data_ptr() + start)).cast("B")


def probe_direct(directory: str) -> bool:
    """True if files in ``directory`` accept an aligned ``O_DIRECT`` write and read."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    path = os.path.join(directory, ".direct-probe")
    buf = aligned_buffer(ALIGN)
    buf.fill_(7)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flag, 0o600)
    except OSError:
        return False
    try:
        return os.pwritev(fd, [_view(buf, 0, ALIGN)], 0) == ALIGN and \
            os.preadv(fd, [_view(buf, 0, ALIGN)], 0) == ALIGN
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


def open_file(path: str, direct: bool, create: bool = True) -> int:
    """Open ``path`` for positional reads and writes, with ``O_DIRECT`` if ``direct``; created if
    ``create``, else a missing file is an error saying the store file was deleted."""
    flags = os.O_RDWR | (os.O_CREAT if create else 0) | (getattr(os, "O_DIRECT", 0) if direct else 0)
    try:
        return os.open(path, flags, 0o600)
    except FileNotFoundError as e:
        raise FileNotFoundError(e.errno, f"parts.offload: {path} is missing; the store file was "
                                         f"deleted") from e


def _full(path: str, nbytes: int, cause: BaseException) -> DiskFullError:
    try:
        st = os.statvfs(os.path.dirname(path))
        free = f"; {st.f_bavail * st.f_frsize} bytes free there"
    except OSError:
        free = ""
    err = DiskFullError(errno.ENOSPC, f"parts.offload: no space for {nbytes} bytes in {path} "
                                      f"({type(cause).__name__}: {cause}{free})")
    err.nbytes, err.path = nbytes, path
    return err


def reserve(fd: int, path: str, nbytes: int) -> None:
    """Allocate ``nbytes`` for the file now (so a full disk fails here, not mid-write)."""
    if OPS.fallocate is None or nbytes == 0:
        return
    try:
        OPS.fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in _FULL:
            raise _full(path, nbytes, e) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def _loop(call: Callable, fd: int, buf: torch.Tensor, length: int, offset: int, path: str,
          writing: bool) -> None:
    """Transfer ``length`` bytes between ``buf`` and the file at ``offset``, looping over short ones."""
    done = 0
    while done < length:
        try:
            n = call(fd, [_view(buf, done, length - done)], offset + done)
        except OSError as e:
            if writing and e.errno in _FULL:
                raise _full(path, length - done, e) from e
            if e.errno is None:
                raise
            raise OSError(e.errno, f"parts.offload: {path}: {e.strerror}") from e
        if n <= 0:
            if writing:
                raise _full(path, length - done, OSError(errno.ENOSPC, "write made no progress"))
            raise OSError(errno.EIO, f"parts.offload: {path} ended {length - done} bytes early "
                                     f"(offset {offset + done}); the store file was truncated")
        done += n


Scratch = Callable[[int], torch.Tensor]
"""``scratch(n)``: this IO thread's aligned bounce buffer, at least ``n`` bytes long."""


def _direct_body(t: torch.Tensor) -> int:
    """Bytes of uint8 tensor ``t`` that direct IO moves straight from or into its memory."""
    n = t.numel()
    return n - n % ALIGN if is_aligned(t) else 0


def _move(fd: int, path: str, t: torch.Tensor, offset: int, scratch: Optional[Scratch], writing: bool) -> int:
    """Write (read) the uint8 tensor ``t`` at ``offset``: buffered when ``scratch`` is None, else
    direct, whole blocks in place if ``t`` is aligned and the rest through ``scratch`` (zero-padded
    to a block when writing; bytes beyond ``t`` are never touched); returns bytes copied."""
    n = t.numel()
    body = _direct_body(t) if scratch is not None else n
    call = OPS.pwritev if writing else OPS.preadv
    if body:
        _loop(call, fd, t, body, offset, path, writing)
    rest = n - body
    if rest:
        padded = round_up(rest)
        bounce = scratch(padded)
        if writing:
            bounce[:rest].copy_(t[body:])
            bounce[rest:padded].zero_()
        _loop(call, fd, bounce, padded, offset + body, path, writing)
        if not writing:
            t[body:].copy_(bounce[:rest])
    return rest


def write_bytes(fd: int, path: str, src: torch.Tensor, offset: int, scratch: Optional[Scratch]) -> int:
    """Write the uint8 tensor ``src`` at ``offset`` (direct IO when ``scratch`` is given); returns bytes copied."""
    return _move(fd, path, src, offset, scratch, True)


def read_bytes(fd: int, path: str, dst: torch.Tensor, offset: int, scratch: Optional[Scratch]) -> int:
    """Read ``dst.numel()`` bytes at ``offset`` into the uint8 tensor ``dst`` (direct IO when ``scratch``
    is given); returns bytes copied."""
    return _move(fd, path, dst, offset, scratch, False)


def bytes_of(t: torch.Tensor, what: str) -> torch.Tensor:
    """The bytes of contiguous CPU tensor ``t`` as a flat uint8 view; a clear error otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"DiskStore: {what} needs a tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"DiskStore: {what} needs a contiguous CPU tensor, got "
                         f"{'a non-contiguous' if t.device.type == 'cpu' else t.device} tensor {tuple(t.shape)}")
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
