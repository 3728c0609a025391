"""The folders of host-memory snapshots (``parts.comm.Snapshots``): layout, owner, commit, scan, prune.

One job's snapshots live under ``<root>/parts-snapshots-<job>/`` (``root``: ``/dev/shm``,
memory that outlives the worker processes)::

    owner.json                    the process that outlives the workers (torchrun's agent)
    node-<g>/gen-<n>/             generation n as node g holds it, committed
        .metadata                 DCP's metadata of the whole snapshot (every rank's items)
        parts_manifest.json       size and SHA-256 of every file of the snapshot, and its step
        __<r>_0.distcp            DCP's file of each rank r of node g, and of the node whose buddy g is
        rank-<r>.pt               that rank's own values: RNG states and the caller's data position
    node-<g>/gen-<n>.saving/      a generation being written (never restored)
    node-<g>/fetch-<n>/           during a restore across hosts: files of generation n node g lacked
    view-<r>/                     during a restore: links to the files rank r loads, wherever they are

A generation becomes ``gen-<n>`` by one rename, after every rank wrote its files and the
node's copy of the manifest was written, so a folder named ``gen-<n>`` was complete when it
was made. A file that changed since (truncated: its size; corrupted: its SHA-256, checked as
it is read) makes that copy unusable; a generation is restorable while every file of its
manifest is whole in some node's folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Optional

from parts.base import owner_records as owner
from parts.base.files import CheckpointError, file_digest, verify_file
from parts.comm.dcp_files import FORMAT, MANIFEST, METADATA

PREFIX = "parts-snapshots-"
OWNER = "owner.json"
_GEN = re.compile(r"^gen-(\d{8})$")
_STAGING = re.compile(r"^(gen-\d{8}\.saving|fetch-\d{8})$")


def default_root() -> Path:
    """``/dev/shm`` where it exists (host memory), else the temporary directory."""
    return Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())


def job_folder(root: Path, job: str) -> Path:
    """The folder of ``job``'s snapshots under ``root``."""
    if not job or "/" in job or job in (".", ".."):
        raise ValueError(f"parts.comm.Snapshots: job {job!r} is not a plain folder name")
    return Path(root) / f"{PREFIX}{job}"


def node_folder(job_dir: Path, node: int) -> Path:
    """The folder of node ``node``'s copies of the job's snapshots."""
    return job_dir / f"node-{node}"


def gen_name(generation: int) -> str:
    """The folder name of a committed generation."""
    return f"gen-{generation:08d}"


def side_name(rank: int) -> str:
    """The file of rank ``rank``'s own values (RNG states, data position)."""
    return f"rank-{rank}.pt"


def claim(job_dir: Path, owner_pid: int, replace_orphaned: bool) -> None:
    """Make ``job_dir`` with its owner record (kept if there: a restarted group's job is the same).
    With ``replace_orphaned``, a folder whose recorded owner is gone belongs to an earlier run
    that reused the job's name: it is removed first, never restored."""
    if replace_orphaned and job_dir.is_dir() and _owner_gone(job_dir, owner.here()):
        shutil.rmtree(job_dir, ignore_errors=True)
    job_dir.mkdir(parents=True, exist_ok=True)
    record = job_dir / OWNER
    if not record.is_file():
        tmp = job_dir / f".{OWNER}.{os.getpid()}"
        tmp.write_text(json.dumps(owner.record(owner_pid)), encoding="utf-8")
        os.replace(tmp, record)


def reclaim(root: Path, keep: Path) -> int:
    """Remove the snapshot folders under ``root`` (not ``keep``) whose owner is gone; the bytes freed."""
    where, freed = owner.here(), 0
    try:
        names = [n for n in os.listdir(root) if n.startswith(PREFIX)]
    except OSError:
        return 0
    for name in names:
        folder = Path(root) / name
        if folder == keep or not folder.is_dir() or not _owner_gone(folder, where):
            continue
        size = folder_bytes(folder)
        shutil.rmtree(folder, ignore_errors=True)
        freed += 0 if folder.exists() else size
    return freed


def _owner_gone(folder: Path, where: dict) -> bool:
    try:
        record = json.loads((folder / OWNER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # no (readable) record: not ours to judge
    return owner.gone(record, where)


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder``."""
    total = 0
    for base, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except OSError:
                continue
    return total


def begin(job_dir: Path, node: int, generation: int) -> Path:
    """The staging folder of ``generation`` on ``node`` (made if missing: a buddy may make it first)."""
    staging = node_folder(job_dir, node) / f"{gen_name(generation)}.saving"
    staging.mkdir(parents=True, exist_ok=True)
    return staging


def copy_files(source: Path, names: Iterable[str], destination: Path) -> None:
    """Copy the named files of ``source`` into ``destination`` (made if missing)."""
    destination.mkdir(parents=True, exist_ok=True)
    for name in names:
        tmp = destination / f".{name}.part"
        shutil.copyfile(source / name, tmp)
        os.replace(tmp, destination / name)


def commit(staging: Path, files: dict[str, dict], expected: Iterable[str], info: dict) -> Path:
    """A node's leader, once every rank wrote: the manifest (every file of the snapshot and this
    copy's ``.metadata``), a check that the files this node holds are there at their sizes, and
    the rename that makes the generation."""
    files = {**files, METADATA: file_digest(staging / METADATA)}
    manifest = {"format": FORMAT, "files": files, "transaction": None, "snapshot": info}
    for name in expected:
        verify_file(staging / name, files[name], checksum=False)
    tmp = staging / f".{MANIFEST}.part"
    tmp.write_text(json.dumps(manifest), encoding="utf-8")
    os.replace(tmp, staging / MANIFEST)
    target = staging.with_name(staging.name[: -len(".saving")])
    os.rename(staging, target)
    return target


def clear_staging(node_dir: Path) -> None:
    """Remove what unfinished saves and restores left in ``node_dir``."""
    for child in _children(node_dir):
        if _STAGING.match(child.name):
            shutil.rmtree(child, ignore_errors=True)


def prune(node_dir: Path, below: int) -> None:
    """Remove the committed generations of ``node_dir`` older than ``below``."""
    for child in _children(node_dir):
        match = _GEN.match(child.name)
        if match and int(match.group(1)) < below:
            shutil.rmtree(child, ignore_errors=True)


def _children(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []


def read_manifest(folder: Path) -> Optional[dict]:
    """The snapshot manifest of a committed generation folder; None if it is not readable."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(manifest, dict) and manifest.get("format") == FORMAT and \
        isinstance(manifest.get("files"), dict) and isinstance(manifest.get("snapshot"), dict)
    return manifest if ok else None


def _copies(job_dir: Path) -> dict[int, list[tuple[Path, dict]]]:
    """Generation -> its committed copies this host sees (folder, manifest), in folder order."""
    found: dict[int, list[tuple[Path, dict]]] = {}
    for node_dir in _children(job_dir):
        for gen_dir in _children(node_dir) if node_dir.name.startswith("node-") else []:
            match = _GEN.match(gen_dir.name)
            manifest = read_manifest(gen_dir) if match else None
            if manifest is not None:
                found.setdefault(int(match.group(1)), []).append((gen_dir, manifest))
    return found


def restorable(job_dir: Path) -> dict[int, dict]:
    """Generation -> ``{"step", "world_size", "sources": {file: folder}}`` for every generation
    whose files are each whole (present at their manifest's size) in some node's folder this
    host sees."""
    out = {}
    for generation, copies in _copies(job_dir).items():
        sources = _sources(copies)
        if sources is not None:
            out[generation] = {**copies[0][1]["snapshot"], "sources": sources}
    return out


def inventory(job_dir: Path) -> dict[int, dict]:
    """Generation -> ``{"snapshot": its step and world, "names": every file of it, "whole":
    {file: (folder, bytes)}, "metadata": the size and SHA-256 of its whole ``.metadata``}`` for
    the files whole in the folders this host sees (``.metadata`` and the manifest both from the
    first copy, or neither)."""
    out = {}
    for generation, copies in _copies(job_dir).items():
        first, manifest = copies[0]
        whole, metadata = {}, None
        if _whole(first / METADATA, manifest["files"].get(METADATA)):
            metadata = manifest["files"][METADATA]
            whole = {METADATA: (str(first), manifest["files"][METADATA]["bytes"]),
                     MANIFEST: (str(first), os.stat(first / MANIFEST).st_size)}
        for name, entry in manifest["files"].items():
            where = next((folder for folder, _ in copies if _whole(folder / name, entry)), None)
            if name != METADATA and where is not None:
                whole[name] = (str(where), entry["bytes"])
        out[generation] = {"snapshot": manifest["snapshot"], "names": sorted({*manifest["files"], MANIFEST}),
                           "whole": whole, "metadata": metadata}
    return out


def _sources(copies: list[tuple[Path, dict]]) -> Optional[dict[str, str]]:
    """Where each file of the snapshot is whole (``.metadata`` and the manifest from one copy), or None."""
    first, manifest = copies[0]
    sources = {METADATA: str(first), MANIFEST: str(first)}
    for name, entry in manifest["files"].items():
        if name == METADATA:
            continue
        where = next((folder for folder, _ in copies if _whole(folder / name, entry)), None)
        if where is None:
            return None
        sources[name] = str(where)
    return sources


def _whole(path: Path, entry: Any) -> bool:
    try:
        return isinstance(entry, dict) and os.stat(path).st_size == entry.get("bytes")
    except OSError:
        return False


def make_view(view: Path, sources: dict[str, str]) -> Path:
    """A folder of links to each file of a snapshot where it is whole: what DCP loads from."""
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    for name, folder in sources.items():
        os.symlink(Path(folder) / name, view / name)
    return view


def verify(view: Path, name: str) -> None:
    """Check ``name`` of a view against its manifest (size and SHA-256): ``CheckpointError`` if not whole."""
    manifest = read_manifest(view)
    entry = manifest["files"].get(name) if manifest else None
    if entry is None:
        raise CheckpointError(f"snapshot {view}: {name} is not in its manifest", path=view / name)
    verify_file(view / name, entry)
