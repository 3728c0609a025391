"""The file side of a DCP checkpoint as a transaction: staging, manifest, commit, verification.

A save writes into a staging folder beside ``<path>`` (``<path>.saving``); every rank fsyncs
and hashes the files it wrote; rank 0 writes DCP's ``.metadata``, then ``parts_manifest.json``
(every file's size and SHA-256, and the save's transaction id), checks the staged checkpoint
against it and only then swaps it in. A new ``<path>`` is the staging folder renamed. Into an
existing ``<path>`` the swap moves file by file, and only the checkpoint's own files: the
previous checkpoint's (those its manifest lists; without one, DCP's ``.metadata`` and
``*.distcp``) move aside into a folder ``<path>.old``, the staged files move in (the manifest
last), then that folder is removed. Every other file and folder of ``<path>`` stays, and
``<path>`` itself is never renamed (it may be the working directory).

A folder is the save's own only if it holds ``parts_transaction.json``, which the save writes
into it first, naming the checkpoint, the folder itself and the transaction. A save or a load
touches no other folder: a user's ``<path>.old`` or ``<path>.saving`` (a backup, notes) stays
as it is, and the save works in ``<path>.old-<id>`` / ``<path>.saving-<id>`` instead. A save
that fails anywhere (a full disk on one rank) leaves ``<path>`` as it was; a process killed
during the swap leaves its own ``.old`` folder, and the next save or load finishes the swap
(the checkpoint's manifest names the transaction) or undoes it (it does not).

A load checks each file it reads against the manifest (missing, truncated, corrupted:
``CheckpointError`` naming the file). A checkpoint without a manifest (written by
``torch.distributed.checkpoint.save`` or FSDP2) loads unverified, as torch loads it.

``.metadata`` is a pickle. It is read with an unpickler that resolves only the classes DCP's
metadata is made of, so a crafted file cannot run code (``os.system``) when it is loaded.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
import pickle
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata

from parts.base.files import (CheckpointError, file_digest, fsync_directory, fsync_file, verify_file,
                              write_json_durably)


MANIFEST = "parts_manifest.json"
METADATA = ".metadata"  # DCP's own name for it
FORMAT = "parts-dcp-manifest/1"
MARKER = "parts_transaction.json"  # in each folder a save makes beside the checkpoint
MARKER_FORMAT = "parts-dcp-transaction/1"
STAGING, PREVIOUS = "saving", "old"  # the roles of those folders, and their names' suffixes


def _absolute(target: Path) -> Path:
    return Path(os.path.abspath(target))  # "." and "a/.." have a name to put a suffix on


def _plain_name(name: str) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name


def _listed(directory: Path) -> list[str]:
    """The files ``directory``'s manifest lists, the manifest among them."""
    return [MANIFEST] + [n for n in _read_manifest(directory)["files"] if _plain_name(n)]


# ------------------------------------------------------------------ the save's own folders
def _marker(folder: Path) -> Optional[dict]:
    """The transaction marker in ``folder``; None without a readable one."""
    try:
        mark = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return mark if isinstance(mark, dict) and mark.get("format") == MARKER_FORMAT else None


def _own(folder: Path, target: Path, role: str, transaction: Optional[str] = None) -> Optional[dict]:
    """``folder``'s marker if a save of ``target`` made ``folder`` for ``role`` (a copy of it
    under another name is not), of ``transaction`` if given; None for every other folder."""
    if folder.is_symlink() or not folder.is_dir():
        return None
    mark = _marker(folder)
    if mark is None or not isinstance(mark.get("transaction"), str) or \
            (mark.get("checkpoint"), mark.get("folder"), mark.get("role")) != (target.name, folder.name, role):
        return None
    return mark if transaction is None or mark.get("transaction") == transaction else None


def _own_folders(target: Path, role: str) -> list[tuple[Path, dict]]:
    """The folders beside ``target`` that a save of it made for ``role``, with their markers."""
    target = _absolute(target)
    found = [(f, _own(f, target, role)) for f in sorted(target.parent.glob(f"{glob.escape(target.name)}.{role}*"))]
    return [(folder, mark) for folder, mark in found if mark is not None]


def _make_own(target: Path, role: str, transaction: str, staging: Optional[Path] = None) -> Path:
    """A new folder beside ``target`` for ``role``, its marker written before anything else:
    ``<path>.<role>``, or ``<path>.<role>-<id>`` where something else has that name."""
    target = _absolute(target)
    names = (f"{target.name}.{role}", f"{target.name}.{role}-{transaction[:8]}")
    folder = next((target.with_name(n) for n in names if not os.path.lexists(target.with_name(n))), None)
    if folder is None:
        raise CheckpointError(f"checkpoint {target}: {names[0]} and {names[1]} beside it are not this save's "
                              f"own folders: rename {names[1]}", path=target.with_name(names[1]))
    folder.mkdir(parents=True)
    mark = {"format": MARKER_FORMAT, "checkpoint": target.name, "folder": folder.name, "role": role,
            "transaction": transaction, **({"staging": staging.name} if staging is not None else {})}
    write_json_durably(mark, folder / MARKER)
    fsync_directory(folder.parent)
    return folder


def _remove_own(folder: Path) -> None:
    """Remove a folder of the save's own, its marker last (a folder left half removed is still known)."""
    for child in folder.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        elif child.name != MARKER:
            child.unlink()
    shutil.rmtree(folder)


def _transaction_of(target: Path) -> Optional[str]:
    """The transaction id the checkpoint's manifest at ``target`` names (None without one)."""
    try:
        manifest = _read_manifest(target)
    except CheckpointError:
        return None
    return manifest.get("transaction") if manifest is not None else None


def _recover(target: Path) -> None:
    """Finish or undo each swap that a killed save of ``target`` left half done (its ``.old`` folder exists)."""
    target = _absolute(target)
    _drop_stray_marker(target)
    for old, mark in _own_folders(target, PREVIOUS):
        name = mark.get("staging")
        staging = old.with_name(name) if _plain_name(name) else None
        if staging is not None and _own(staging, target, STAGING, mark.get("transaction")) is None:
            staging = None
        if target.is_dir() and _transaction_of(target) == mark.get("transaction"):
            _remove_own(old)  # the new checkpoint is complete in place: finish
        else:
            _undo(target, old, staging)
        if staging is not None:
            _remove_own(staging)
        fsync_directory(target)
        fsync_directory(target.parent)


def _undo(target: Path, old: Path, staging: Optional[Path]) -> None:
    """Remove what the swap moved into ``target`` from ``staging`` and move ``old``'s files back."""
    target.mkdir(exist_ok=True)
    if staging is not None and (staging / MANIFEST).is_file():
        for name in _listed(staging):
            if not (staging / name).exists():
                (target / name).unlink(missing_ok=True)
    for moved in old.iterdir():
        if moved.name != MARKER:
            os.rename(moved, target / moved.name)
    (old / MARKER).unlink()
    old.rmdir()


def _drop_stray_marker(target: Path) -> None:
    """Remove the staging marker a save killed right after renaming its staging folder to ``target`` left."""
    mark = _marker(target)
    if mark is not None and (mark.get("checkpoint"), mark.get("role")) == (target.name, STAGING):
        (target / MARKER).unlink()


def begin(target: Path) -> Path:
    """Rank 0, before a save: recover, clear what an earlier failed save left, make the staging folder."""
    _recover(target)
    for stale, _ in _own_folders(target, STAGING):
        abandon(stale)
    return _make_own(target, STAGING, uuid.uuid4().hex)


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
    manifest = {"format": FORMAT, "files": files, "transaction": (_marker(staging) or {}).get("transaction")}
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
        (target / MARKER).unlink()
        fsync_directory(target)
        return
    if not target.is_dir():
        raise CheckpointError(f"checkpoint {target} is a file, not a directory: not replacing it", path=target)
    incoming = sorted(_listed(staging), key=lambda name: name == MANIFEST)  # the manifest last
    old = _make_own(target, PREVIOUS, _marker(staging)["transaction"], staging)
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
    _remove_own(old)
    abandon(staging)


def abandon(staging: Path) -> None:
    """Rank 0, after a failed save: free what it wrote (the save's own staging folder)."""
    with contextlib.suppress(OSError):
        _remove_own(staging)


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
        unfinished = [str(folder) for folder, _ in _own_folders(target, STAGING)]
        hint = f" ({', '.join(unfinished)}: an unfinished save, not a checkpoint)" if unfinished else ""
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
