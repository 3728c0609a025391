"""Files that must survive a crash or be refused: checksums, fsync, the checkpoint error.

``parts.io`` (one-file checkpoints) and ``parts.comm.dcp`` (sharded DCP checkpoints) both
write, fsync, rename and verify by size and SHA-256; the pieces they share live here, below
both of them, so there is one way to hash a file and one ``CheckpointError``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Union


CHUNK = 8 << 20  # bytes hashed per read

PathLike = Union[str, os.PathLike]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated, corrupted, not loadable, or a step of saving or
    loading it failed on some rank; ``path`` and ``failures`` (rank -> what went wrong) say where."""

    def __init__(self, message: str, *, path: Optional[PathLike] = None,
                 failures: Optional[Mapping[int, str]] = None) -> None:
        super().__init__(message)
        self.path = None if path is None else str(path)
        self.failures = dict(failures or {})

    @property
    def ranks(self) -> list[int]:
        """The ranks the failure happened on (empty when not a collective step)."""
        return sorted(self.failures)

    def __reduce__(self) -> tuple:
        return (_rebuild, (type(self), str(self), self.path, self.failures))


def _rebuild(cls: type, message: str, path: Optional[str], failures: dict) -> CheckpointError:
    return cls(message, path=path, failures=failures)


def sha256_of(handle: Any, offset: int, length: int) -> str:
    """SHA-256 of ``length`` bytes of the open binary ``handle`` from ``offset``, read in
    ``CHUNK`` pieces into one reused buffer (stops early at the end of the file)."""
    digest, buffer = hashlib.sha256(), bytearray(min(CHUNK, max(1, length)))
    view, left = memoryview(buffer), length
    handle.seek(offset)
    while left:
        got = handle.readinto(view[:min(left, len(buffer))])
        if not got:
            break
        digest.update(view[:got])
        left -= got
    return digest.hexdigest()


def file_digest(path: PathLike) -> dict:
    """``{"bytes": size, "sha256": hex}`` of the file at ``path``, read from the file system."""
    with open(path, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        return {"bytes": size, "sha256": sha256_of(handle, 0, size)}


def verify_file(path: PathLike, expected: Mapping[str, Any], checksum: bool = True) -> None:
    """Raise ``CheckpointError`` naming ``path`` if it is missing, of another size than
    ``expected["bytes"]`` or (with ``checksum``) of another SHA-256 than ``expected["sha256"]``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing (the manifest lists it)", path=path)
    size = path.stat().st_size
    if size != expected["bytes"]:
        raise CheckpointError(f"checkpoint file {path} is truncated or overwritten: {size} bytes on disk, "
                              f"the manifest records {expected['bytes']}", path=path)
    if checksum and file_digest(path)["sha256"] != expected["sha256"]:
        raise CheckpointError(f"checkpoint file {path} is corrupted: its SHA-256 does not match the "
                              f"manifest", path=path)


def fsync_file(path: PathLike) -> None:
    """Flush ``path``'s data to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(directory: PathLike) -> None:
    """Make renames and new entries in ``directory`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask() -> int:
    """The process's file-creation mask (read without changing it for long)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json_durably(obj: Any, path: PathLike) -> None:
    """``obj`` as JSON at ``path``: written to a temporary name, fsynced, renamed into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(obj, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
