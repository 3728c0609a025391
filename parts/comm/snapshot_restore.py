"""Restoring a host-memory snapshot (``parts.comm.Snapshots.restore``), and the per-rank values
a snapshot holds beside the DCP state: the RNG states and the caller's data position.

Every rank lists the generations it can restore from the folders it sees (each file whole in
some node's folder: ``snapshot_files.restorable``); the ranks take the newest generation on
every rank's list. Its files are linked into one folder per rank, wherever each is whole (a
node's own copy, or its buddy's), and ``parts.comm.dcp.load`` reads them: the manifest's
SHA-256 of every file read, and DCP's resharding when the world changed. A generation that
fails there (a corrupted file) is refused on every rank alike, and the next older one tried.
On hosts that do not share memory, ``snapshot_fetch`` lists the generations whole on some
host and moves the files each node lacks before the load.
"""

from __future__ import annotations

import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from parts.base.device import accelerator_device
from parts.base.files import CheckpointError
from parts.comm import dcp
from parts.comm import snapshot_files as files
from parts.comm.group import GroupInfo
from parts.comm.objects import all_gather_objects
from parts.comm.snapshot_fetch import Fetch, Net


@dataclass
class Restored:
    """What ``Snapshots.restore`` loaded: its ``step`` and ``generation``; this rank's ``local``
    value and RNG states (``rng_restored``) where the world is the one that saved it;
    ``seconds`` the restore took, ``disk_bytes`` this process read from storage meanwhile and
    ``fetched_bytes`` it received from other hosts (snapshots over the network)."""

    step: int
    generation: int
    local: Any
    rng_restored: bool
    seconds: float
    disk_bytes: int
    fetched_bytes: int = 0


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch's CPU generator, the accelerator's, Python's ``random``."""
    device = accelerator_device()
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device is not None and device.type == "cuda" and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back the RNG states ``rng_state`` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], accelerator_device())


def read_bytes() -> int:
    """Bytes this process has read from storage (``/proc/self/io``; memory-backed files count none)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration, ValueError):
        return 0


def restore(state: dict[str, Any], job_dir: Path, info: GroupInfo, net: Optional[Net] = None) -> Optional[Restored]:
    """Load the newest snapshot every rank can read into ``state``; None if there is none.
    With ``net`` (hosts that do not share memory), each node first receives the files it lacks."""
    began, read_before = time.perf_counter(), read_bytes()
    fetch = Fetch(job_dir, info, net) if net is not None else None
    order, entry_of = _candidates(job_dir, info, fetch)
    restored = None
    for generation in order:
        found = _try(state, job_dir, info, generation, entry_of(state, generation))
        if found is not None:
            step, local, same_world = found
            restored = Restored(step, generation, local, same_world, time.perf_counter() - began,
                                read_bytes() - read_before, fetch.fetched_bytes if fetch else 0)
            break
    if fetch is not None:  # every rank loaded: a node's fetched files can go
        all_gather_objects(None, info.group)
        fetch.clear()
    return restored


def _candidates(job_dir: Path, info: GroupInfo, fetch: Optional[Fetch]) -> tuple[list[int], Callable]:
    """The generations to try, newest first, and how to get one's entry (step, world, sources)."""
    if fetch is not None:
        return fetch.generations(), fetch.entry
    mine = files.restorable(job_dir)
    common = set(mine)
    for theirs in all_gather_objects(sorted(mine), info.group):
        common &= set(theirs)
    return sorted(common, reverse=True), lambda state, generation: mine[generation]


def _try(state: dict[str, Any], job_dir: Path, info: GroupInfo, generation: int,
         entry: dict) -> Optional[tuple[int, Any, bool]]:
    """Load ``generation`` (every rank alike): (step, this rank's local value, RNG restored), or None."""
    view = files.make_view(job_dir / f"view-{info.rank}", entry["sources"])
    try:
        same_world = entry.get("world_size") == info.world_size
        side, error = _side(view, info.rank) if same_world else (None, None)
        if any(e is not None for e in all_gather_objects(error, info.group)):
            return None  # a rank's own values are not whole: refused on every rank
        try:
            dcp.load(state, checkpoint_id=view, group=info.group)
        except CheckpointError:
            return None
        if side is not None:
            set_rng_state(side["rng"])
        return int(entry["step"]), (side or {}).get("local"), same_world
    finally:
        shutil.rmtree(view, ignore_errors=True)


def _side(view: Path, rank: int) -> tuple[Optional[dict], Optional[str]]:
    """This rank's own values in the view (checked against the manifest), or the error why not."""
    name = files.side_name(rank)
    try:
        files.verify(view, name)
        return torch.load(view / name, weights_only=True), None
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it and refuse the generation
        return None, f"{type(exc).__name__}: {exc}"
