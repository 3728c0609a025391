"""Crash-safe checkpoint files: write, fsync, rename; verify on load.

``save(obj, path)`` writes ``obj`` (a nested dict of tensors and plain values, such as a
``full_state_dict`` or ``BF16Optimizer.state_dict``) to a temporary file in the same
directory, fsyncs it and atomically renames it over ``path``, so a process killed at any
moment leaves either the previous file or the new one, never a torn one. A manifest
(format version, world size, step, tensor names/shapes/dtypes and a SHA-256 of the
payload) rides along inside the file; ``load`` checks it and refuses a truncated or
corrupted file with ``CheckpointError``. Loading never unpickles code
(``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from glob import escape as glob_escape
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch

__all__ = ["CheckpointError", "save", "load", "read_manifest", "check_loadable"]

FORMAT = "parts-checkpoint/1"
_MAGIC = b"PARTSCK1"
_HEADER_BYTES = len(_MAGIC) + 8 + 8  # magic, manifest length, payload length

PathLike = Union[str, os.PathLike]


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupted or not a ``parts`` checkpoint."""


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


def _manifest(obj: Any, payload: bytes, world_size: Optional[int], step: Optional[int]) -> dict:
    tensors: dict[str, dict] = {}
    for name, t in _tensor_entries(obj):
        if name in tensors:
            raise ValueError(f"parts.io.save: two tensors are both named {name!r} in the manifest "
                             f"(a key with a dot beside nested dicts, or 0 beside '0'); load "
                             f"could not tell them apart. Rename one of the keys")
        tensors[name] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    return {"format": FORMAT, "world_size": world_size, "step": step, "tensors": tensors,
            "payload_bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}


def _serialize(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def save(obj: Any, path: PathLike, *, world_size: Optional[int] = None,
         step: Optional[int] = None) -> dict:
    """Write ``obj`` to ``path`` atomically with a manifest; return the manifest.

    Raises before writing anything if ``load`` could not read ``obj`` back (a value type
    ``weights_only`` refuses, two tensors with the same manifest name)."""
    path = Path(path)
    check_loadable(obj)
    _manifest(obj, b"", world_size, step)  # names checked before the payload is built
    payload = _serialize(obj)
    manifest = _manifest(obj, payload, world_size, step)
    header = _serialize(manifest)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.",
                                    suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # what open() (and torch.save) gives; mkstemp gives 0600
        with os.fdopen(fd, "wb") as handle:
            handle.write(_MAGIC + len(header).to_bytes(8, "little") + len(payload).to_bytes(8, "little"))
            handle.write(header)
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return manifest


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_sections(path: Path) -> tuple[bytes, bytes]:
    """The manifest and payload bytes of ``path``, checked for truncation."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    data = path.read_bytes()
    if len(data) < _HEADER_BYTES or not data.startswith(_MAGIC):
        raise CheckpointError(f"{path} is not a parts checkpoint (bad header; truncated or foreign file)")
    manifest_bytes = int.from_bytes(data[8:16], "little")
    payload_bytes = int.from_bytes(data[16:24], "little")
    expected = _HEADER_BYTES + manifest_bytes + payload_bytes
    if len(data) != expected:
        raise CheckpointError(f"checkpoint {path} is truncated or has trailing bytes: "
                              f"{len(data)} bytes on disk, the header promises {expected}")
    start = _HEADER_BYTES
    return data[start:start + manifest_bytes], data[start + manifest_bytes:]


def _loads(blob: bytes, path: Path, what: str) -> Any:
    try:
        return torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    except Exception as error:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointError(f"checkpoint {path}: cannot read its {what} ({error})") from error


def read_manifest(path: PathLike) -> dict:
    """The manifest of ``path`` (world size, step, tensor names and shapes, checksum)."""
    path = Path(path)
    manifest_blob, _ = _read_sections(path)
    return _loads(manifest_blob, path, "manifest")


def load(path: PathLike) -> Any:
    """Read a checkpoint written by ``save``, verifying its checksum and tensor shapes."""
    path = Path(path)
    manifest_blob, payload = _read_sections(path)
    manifest = _loads(manifest_blob, path, "manifest")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    if hashlib.sha256(payload).hexdigest() != manifest["sha256"]:
        raise CheckpointError(f"checkpoint {path} is corrupted: SHA-256 of its payload does not match the manifest")
    obj = _loads(payload, path, "payload")
    for name, tensor in _tensor_entries(obj):
        recorded = manifest["tensors"].get(name)
        if recorded is None or recorded["shape"] != list(tensor.shape):
            raise CheckpointError(f"checkpoint {path}: tensor {name!r} does not match its manifest entry")
    return obj
