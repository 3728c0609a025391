"""The file side of a DCP checkpoint as a transaction: staging, manifest, commit, verification.

A save writes into ``<path>.saving``; every rank fsyncs and hashes the files it wrote; rank 0
writes DCP's ``.metadata``, then ``parts_manifest.json`` (every file's size and SHA-256),
checks the staged checkpoint against it and only then swaps it in. A new ``<path>`` is the
staging directory renamed. Into an existing ``<path>`` the swap moves file by file, and only
the checkpoint's own files: the previous checkpoint's (those its manifest lists; without one,
DCP's ``.metadata`` and ``*.distcp``) move aside into ``<path>.old``, the staged files move in
(the manifest last), then ``<path>.old`` is removed. Every other file and folder of ``<path>``
stays, and ``<path>`` itself is never renamed (it may be the working directory). A save that
fails anywhere (a full disk on one rank) leaves ``<path>`` as it was; a process killed during
the swap leaves ``<path>.old``, and the next save or load finishes the swap (the new manifest
is in place) or undoes it (it is not).

A load checks each file it reads against the manifest (missing, truncated, corrupted:
``CheckpointError`` naming the file). A checkpoint without a manifest (written by
``torch.distributed.checkpoint.save`` or FSDP2) loads unverified, as torch loads it.

``.metadata`` is a pickle. It is read with an unpickler that resolves only the classes DCP's
metadata is made of, so a crafted file cannot run code (``os.system``) when it is loaded.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata

from parts.base.files import (CheckpointError, file_digest, fsync_directory, fsync_file, verify_file,
                              write_json_durably)


MANIFEST = "parts_manifest.json"
METADATA = ".metadata"  # DCP's own name for it
FORMAT = "parts-dcp-manifest/1"


def _absolute(target: Path) -> Path:
    return Path(os.path.abspath(target))  # "." and "a/.." have a name to put a suffix on


def staging_path(target: Path) -> Path:
    """Where a save into ``target`` writes before it commits."""
    target = _absolute(target)
    return target.with_name(target.name + ".saving")


def _previous_path(target: Path) -> Path:
    target = _absolute(target)
    return target.with_name(target.name + ".old")


def _plain_name(name: str) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name


def _listed(directory: Path) -> list[str]:
    """The files ``directory``'s manifest lists, the manifest among them."""
    return [MANIFEST] + [n for n in _read_manifest(directory)["files"] if _plain_name(n)]


def _recover(target: Path) -> None:
    """Finish or undo a swap that a killed save left half done (``<path>.old`` exists)."""
    old, staging = _previous_path(target), staging_path(target)
    if not old.is_dir():
        return
    if not target.exists():  # a whole checkpoint moved aside
        os.rename(old, target)
    elif (staging / MANIFEST).is_file():  # the new manifest never moved in: undo
        for name in _listed(staging):
            if not (staging / name).exists():
                (target / name).unlink(missing_ok=True)
        for moved in old.iterdir():
            os.rename(moved, target / moved.name)
        old.rmdir()
    else:  # the new checkpoint is complete in place
        shutil.rmtree(old)
        shutil.rmtree(staging, ignore_errors=True)
    fsync_directory(target)
    fsync_directory(target.parent)


def begin(target: Path) -> Path:
    """Rank 0, before a save: recover, clear what an earlier failed save left, make the staging dir."""
    _recover(target)
    staging = staging_path(target)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def digests(directory: Path, names: Iterable[str]) -> dict[str, dict]:
    """Size and SHA-256 of each named file of ``directory``, each fsynced first."""
    out = {}
    for name in sorted(set(names)):
        fsync_file(directory / name)
        out[name] = file_digest(directory / name)
    return out


def write_failed(staging: Path, rank: int, error: BaseException) -> CheckpointError:
    """The error of a rank whose DCP writes into ``staging`` raised ``error``, naming its files."""
    mine = sorted(p.name for p in staging.glob(f"__{rank}_*"))
    cause = _os_error_under(error)
    under = f" (from {type(cause).__name__}: {cause})" if cause is not None and cause is not error else ""
    return CheckpointError(f"writing {', '.join(mine) or 'its files'} in {staging} failed: "
                           f"{type(error).__name__}: {error}{under}", path=staging)


def _os_error_under(error: BaseException) -> Optional[OSError]:
    """The first ``OSError`` in ``error``'s chain (torch's serializer reports a full disk as
    a RuntimeError raised while handling it)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def written_files(results: Iterable[Any]) -> list[str]:
    """The files a rank's DCP ``WriteResult``s landed in (relative to the checkpoint)."""
    return [r.storage_data.relative_path for r in results
            if isinstance(getattr(r.storage_data, "relative_path", None), str)]


def seal(staging: Path, files: dict[str, dict]) -> dict:
    """Rank 0, after DCP wrote ``.metadata``: write the manifest and check the staged checkpoint
    against it (every file present at its size, metadata readable and naming only listed files)."""
    fsync_file(staging / METADATA)
    files = {**files, METADATA: file_digest(staging / METADATA)}
    manifest = {"format": FORMAT, "files": files}
    write_json_durably(manifest, staging / MANIFEST)
    for name, entry in files.items():
        verify_file(staging / name, entry, checksum=False)
    unlisted = {info.relative_path for info in read_metadata(staging).storage_data.values()} - set(files)
    if unlisted:
        raise CheckpointError(f"checkpoint {staging}: .metadata names files no rank reported writing: "
                              f"{sorted(unlisted)}", path=staging)
    return manifest


def _own_files(target: Path, incoming: Iterable[str]) -> list[str]:
    """The files of ``target`` a save replaces: the previous checkpoint's (by its manifest; without
    one, DCP's ``.metadata`` and ``*.distcp``) and any of the names the new checkpoint writes."""
    names = {MANIFEST, METADATA, *incoming}
    try:
        names.update(_listed(target) if (target / MANIFEST).is_file() else ())
    except CheckpointError:
        pass  # an unreadable manifest: what it listed is not known to be ours
    if not (target / MANIFEST).is_file():
        names.update(p.name for p in target.glob("*.distcp"))
    return sorted(n for n in names if (target / n).is_file() or (target / n).is_symlink())


def commit(staging: Path, target: Path) -> None:
    """Rank 0: put the sealed ``staging`` in place of the checkpoint at ``target``, keeping every
    file of ``target`` that is not the checkpoint's own."""
    if not target.exists():
        os.rename(staging, target)
        fsync_directory(_absolute(target).parent)
        return
    if not target.is_dir():
        raise CheckpointError(f"checkpoint {target} is a file, not a directory: not replacing it", path=target)
    incoming = sorted(_listed(staging), key=lambda name: name == MANIFEST)  # the manifest last
    old = _previous_path(target)
    shutil.rmtree(old, ignore_errors=True)
    old.mkdir()
    try:
        for name in _own_files(target, incoming):
            os.rename(target / name, old / name)
        fsync_directory(old)
        for name in incoming:
            os.rename(staging / name, target / name)
        fsync_directory(target)
    except BaseException:
        _recover(target)
        raise
    shutil.rmtree(old)
    shutil.rmtree(staging, ignore_errors=True)


def abandon(staging: Path) -> None:
    """Rank 0, after a failed save: free what it wrote."""
    shutil.rmtree(staging, ignore_errors=True)


def _read_manifest(target: Path) -> Optional[dict]:
    path = target / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"checkpoint manifest {path} cannot be read ({error})", path=path) from error
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or \
            not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"checkpoint manifest {path} is not a {FORMAT} manifest", path=path)
    return manifest


def open_checkpoint(target: Path) -> Optional[dict]:
    """Rank 0, before a load: the checkpoint's manifest (None without one), its ``.metadata``
    verified against it; ``CheckpointError`` for a missing or incomplete checkpoint."""
    _recover(target)
    if not target.is_dir():
        unfinished = staging_path(target)
        hint = f" ({unfinished} is an unfinished save, not a checkpoint)" if unfinished.exists() else ""
        raise CheckpointError(f"checkpoint {target} does not exist{hint}", path=target)
    manifest = _read_manifest(target)
    if not (target / METADATA).is_file():
        raise CheckpointError(f"checkpoint {target} has no {METADATA}: it is not a complete DCP checkpoint",
                              path=target / METADATA)
    if manifest is not None:
        _verify_listed(target, manifest, METADATA)
    return manifest


def _verify_listed(target: Path, manifest: dict, name: str) -> None:
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(f"checkpoint {target}: file {name} is not in its manifest {MANIFEST}",
                              path=target / name)
    verify_file(target / name, entry)


def verify_reads(target: Path, manifest: Optional[dict], names: Iterable[str]) -> None:
    """Check each file this rank reads against the manifest (nothing without a manifest)."""
    if manifest is not None:
        for name in sorted(set(names)):
            _verify_listed(target, manifest, name)


# ------------------------------------------------------------------ metadata without code
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a torch.layout by its name
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "pathlib._local": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


@functools.cache
def _dtype_names() -> frozenset[str]:
    return frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves DCP's metadata classes, torch dtypes and paths; refuses every other global."""

    def __init__(self, handle: Any, path: Path) -> None:
        super().__init__(handle)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        """The global ``module.name`` if DCP metadata is made of it, else ``CheckpointError``."""
        if name in _ALLOWED.get(module, ()) or (module == "torch" and name in _dtype_names()):
            return super().find_class(module, name)
        raise CheckpointError(f"checkpoint metadata {self.path} refers to {module}.{name}, which DCP's "
                              f"metadata never holds: refusing to unpickle it (unpickling runs code; "
                              f"parts loads only DCP's own metadata classes)", path=self.path)

    def persistent_load(self, pid: Any) -> Any:
        """DCP metadata has no persistent ids."""
        raise CheckpointError(f"checkpoint metadata {self.path} holds a persistent id: not DCP metadata",
                              path=self.path)


def read_metadata(directory: Path) -> Metadata:
    """DCP's ``.metadata`` of ``directory``, unpickled with the allow-list above."""
    path = directory / METADATA
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle, path).load()
    except CheckpointError:
        raise
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as error:
        raise CheckpointError(f"checkpoint metadata {path} cannot be read ({type(error).__name__}: {error})",
                              path=path) from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint metadata {path} holds a {type(metadata).__name__}, not DCP "
                              f"Metadata", path=path)
    return metadata
