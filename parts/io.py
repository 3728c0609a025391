"""Crash-safe checkpoint files: write, fsync, rename; verify on load.

``save(obj, path)`` writes ``obj`` (a nested dict of tensors and plain values, such as a
``full_state_dict`` or ``BF16Optimizer.state_dict``) to a temporary file in the same
directory, fsyncs it and atomically renames it over ``path``, so a process killed at any
moment leaves either the previous file or the new one, never a torn one. A manifest
(format version, world size, step, tensor names/shapes/dtypes and a SHA-256 of the
payload) rides along inside the file; ``load`` checks it and refuses a truncated or
corrupted file with ``CheckpointError``. Loading never unpickles code
(``torch.load(weights_only=True)``).

Both directions stream: ``save`` serializes straight into the file, hashing as it writes
(no in-memory copy of the payload), and ``load`` hashes the file in 8 MiB chunks, then lets
``torch.load`` read the payload's records from the file into their tensors, so it holds
what ``torch.load`` of a plain file holds. Layout (format 2): a fixed header (magic,
payload and manifest lengths, the manifest's SHA-256), the payload, the manifest. Files of
format 1 (manifest before payload) still load.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from dataclasses import dataclass
from glob import escape as glob_escape
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch

from parts.base.files import CheckpointError, fsync_directory, sha256_of, umask

__all__ = ["CheckpointError", "save", "load", "read_manifest", "check_loadable"]

FORMAT = "parts-checkpoint/1"  # the manifest's format field (unchanged by the file layout)
_MAGIC_V1 = b"PARTSCK1"  # header, manifest, payload (read only)
_MAGIC = b"PARTSCK2"  # header, payload, manifest: written by save
_HEADER_V1 = len(_MAGIC_V1) + 8 + 8  # magic, manifest length, payload length
_HEADER_BYTES = len(_MAGIC) + 8 + 8 + 32  # magic, payload length, manifest length, manifest SHA-256

PathLike = Union[str, os.PathLike]


def _tensor_entries(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a nested dict/list, with a dotted path naming it."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensor_entries(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _tensor_entries(value, f"{prefix}.{index}" if prefix else str(index))


_PLAIN = (str, bytes, int, float, bool, type(None), torch.Size, torch.dtype, torch.device)
_HINT = {"Namespace": "vars(args)", "PosixPath": "str(path)", "WindowsPath": "str(path)"}


def check_loadable(obj: Any, where: str = "obj") -> None:
    """Raise ``TypeError`` naming the first value ``load`` (``weights_only``) would refuse:
    only tensors, numbers, strings, bytes, None, dtypes, devices, lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor) or (isinstance(obj, _PLAIN) and type(obj) in _PLAIN):
        return
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        for index, value in enumerate(obj):
            check_loadable(value, f"{where}[{index}]")
        return
    if isinstance(obj, dict) and type(obj).__name__ in ("dict", "OrderedDict"):
        for key, value in obj.items():
            check_loadable(key, f"a key of {where}")
            check_loadable(value, f"{where}[{key!r}]")
        return
    name = type(obj).__name__
    hint = _HINT.get(name, ".item()/.tolist()" if type(obj).__module__ == "numpy" else "a dict "
                     "of plain values")
    raise TypeError(f"parts.io.save: {where} is a {type(obj).__module__}.{name}, which "
                    f"parts.io.load (torch.load weights_only=True) refuses; the file could not be "
                    f"loaded. Save plain values instead (e.g. {hint})")


def _manifest(obj: Any, payload_bytes: int, sha256: str, world_size: Optional[int],
              step: Optional[int]) -> dict:
    """The manifest of ``obj``; raises if two tensors would get the same name in it."""
    tensors: dict[str, dict] = {}
    for name, t in _tensor_entries(obj):
        if name in tensors:
            raise ValueError(f"parts.io.save: two tensors are both named {name!r} in the manifest "
                             f"(a key with a dot beside nested dicts, or 0 beside '0'); load "
                             f"could not tell them apart. Rename one of the keys")
        tensors[name] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    return {"format": FORMAT, "world_size": world_size, "step": step, "tensors": tensors,
            "payload_bytes": payload_bytes, "sha256": sha256}


def _serialize(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


class _HashingWriter:
    """A write-only file object that hashes and counts what goes through it to ``handle``."""

    def __init__(self, handle: Any) -> None:
        self.handle, self.digest, self.count = handle, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        """Hash ``data`` (bytes or a memoryview of a tensor's storage) and write it."""
        size = memoryview(data).nbytes
        self.digest.update(data)
        self.handle.write(data)
        self.count += size
        return size

    def flush(self) -> None:
        """Flush the underlying file."""
        self.handle.flush()


def save(obj: Any, path: PathLike, *, world_size: Optional[int] = None,
         step: Optional[int] = None) -> dict:
    """Write ``obj`` to ``path`` atomically with a manifest; return the manifest.

    Raises before writing anything if ``load`` could not read ``obj`` back (a value type
    ``weights_only`` refuses, two tensors with the same manifest name). Streams: the payload
    is serialized into the file as it is hashed, never held in memory."""
    path = Path(path)
    check_loadable(obj)
    _manifest(obj, 0, "", world_size, step)  # names checked before anything is written
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.",
                                    suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~umask())  # what open() (and torch.save) gives; mkstemp gives 0600
        with os.fdopen(fd, "wb") as handle:
            manifest = _write_sections(handle, obj, world_size, step)
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
    return manifest


def _write_sections(handle: Any, obj: Any, world_size: Optional[int], step: Optional[int]) -> dict:
    """Header placeholder, streamed payload, manifest, then the real header; the manifest."""
    handle.write(bytes(_HEADER_BYTES))
    writer = _HashingWriter(handle)
    torch.save(obj, writer)
    manifest = _manifest(obj, writer.count, writer.digest.hexdigest(), world_size, step)
    manifest_blob = _serialize(manifest)
    handle.write(manifest_blob)
    handle.seek(0)
    handle.write(_MAGIC + writer.count.to_bytes(8, "little") + len(manifest_blob).to_bytes(8, "little")
                 + hashlib.sha256(manifest_blob).digest())
    handle.flush()
    return manifest


def _remove_stale_temporaries(path: Path) -> None:
    """Delete temporary files of earlier saves to ``path`` whose writing process is gone
    (killed mid-write); a save still running in another live process keeps its file."""
    for tmp in path.parent.glob(f".{glob_escape(path.name)}.*.tmp"):
        pid = tmp.name[len(path.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class _Sections:
    """Where the payload and the manifest of a checkpoint file are (byte offsets, lengths)."""

    payload_offset: int
    payload_bytes: int
    manifest_offset: int
    manifest_bytes: int
    manifest_sha256: Optional[bytes]  # None in format-1 files


def _locate(path: Path, handle: Any) -> _Sections:
    """Parse the header of ``handle`` and check the file's size against it."""
    head = handle.read(_HEADER_BYTES)
    if head.startswith(_MAGIC) and len(head) == _HEADER_BYTES:
        payload_bytes, manifest_bytes = (int.from_bytes(head[o:o + 8], "little") for o in (8, 16))
        sections = _Sections(_HEADER_BYTES, payload_bytes, _HEADER_BYTES + payload_bytes,
                             manifest_bytes, head[24:56])
    elif head.startswith(_MAGIC_V1) and len(head) >= _HEADER_V1:
        manifest_bytes, payload_bytes = (int.from_bytes(head[o:o + 8], "little") for o in (8, 16))
        sections = _Sections(_HEADER_V1 + manifest_bytes, payload_bytes, _HEADER_V1,
                             manifest_bytes, None)
    else:
        raise CheckpointError(f"{path} is not a parts checkpoint (bad header; truncated or foreign file)")
    expected = sections.payload_offset + payload_bytes + (manifest_bytes if sections.manifest_sha256 else 0)
    size = os.fstat(handle.fileno()).st_size
    if size != expected:
        raise CheckpointError(f"checkpoint {path} is truncated or has trailing bytes: "
                              f"{size} bytes on disk, the header promises {expected}")
    return sections


def _read_manifest(path: Path, handle: Any, sections: _Sections) -> dict:
    """The manifest, its checksum verified (format 2) and its format checked."""
    handle.seek(sections.manifest_offset)
    blob = handle.read(sections.manifest_bytes)
    if sections.manifest_sha256 is not None and hashlib.sha256(blob).digest() != sections.manifest_sha256:
        raise CheckpointError(f"checkpoint {path} is corrupted: SHA-256 of its manifest does not "
                              f"match the header")
    manifest = _loads(io.BytesIO(blob), path, "manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"checkpoint {path} has format {found!r}, expected {FORMAT!r}")
    return manifest


def _payload_sha256(handle: Any, sections: _Sections) -> str:
    """SHA-256 of the payload, read from the file in 8 MiB pieces."""
    return sha256_of(handle, sections.payload_offset, sections.payload_bytes)


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of ``handle`` from ``offset``: what
    ``torch.load`` reads the payload through (each record straight into its tensor)."""

    def __init__(self, handle: Any, offset: int, length: int) -> None:
        super().__init__()
        self._handle, self._offset, self._length, self._pos = handle, offset, length, 0

    def readable(self) -> bool:
        """Always readable."""
        return True

    def seekable(self) -> bool:
        """Always seekable."""
        return True

    def tell(self) -> int:
        """Position inside the window."""
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        """Move inside the window (``SEEK_END`` is the window's end)."""
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        """Read up to ``len(buffer)`` bytes of the window into ``buffer``."""
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        self._handle.seek(self._offset + self._pos)
        got = self._handle.readinto(view[:n]) if n else 0
        self._pos += got
        return got


def _loads(source: Any, path: Path, what: str) -> Any:
    try:
        return torch.load(source, weights_only=True, map_location="cpu")
    except Exception as error:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointError(f"checkpoint {path}: cannot read its {what} ({error})") from error


def _open(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    return open(path, "rb", buffering=0)


def read_manifest(path: PathLike) -> dict:
    """The manifest of ``path`` (world size, step, tensor names and shapes, checksum)."""
    path = Path(path)
    with _open(path) as handle:
        return _read_manifest(path, handle, _locate(path, handle))


def load(path: PathLike) -> Any:
    """Read a checkpoint written by ``save``, verifying its checksum and tensor shapes.

    Peak memory is what ``torch.load`` of the payload holds (the loaded tensors) plus one
    8 MiB read buffer: the checksum is computed from the file, not from a copy in memory."""
    path = Path(path)
    with _open(path) as handle:
        sections = _locate(path, handle)
        manifest = _read_manifest(path, handle, sections)
        if _payload_sha256(handle, sections) != manifest["sha256"]:
            raise CheckpointError(f"checkpoint {path} is corrupted: SHA-256 of its payload does not match the manifest")
        obj = _loads(_Window(handle, sections.payload_offset, sections.payload_bytes), path, "payload")
    for name, tensor in _tensor_entries(obj):
        recorded = manifest["tensors"].get(name)
        if recorded is None or recorded["shape"] != list(tensor.shape):
            raise CheckpointError(f"checkpoint {path}: tensor {name!r} does not match its manifest entry")
    return obj
