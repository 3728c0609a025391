"""Restoring a snapshot on hosts that do not share memory (``parts.comm.Snapshots`` over the
network): the files a node lacks come from a rank that holds them.

Every rank lists, per committed generation, the files whole in the folders its host sees
(``snapshot_files.inventory``); the ranks exchange the lists, so each one knows the same
thing. A generation is a candidate while every file of it is whole on some host. To load one,
each node whose folders lack its ``.metadata`` and manifest receives the pair from one holder;
then each rank asks for the files its load reads (DCP's load plan of its state dict on that
metadata, and its own values where the world is the one that saved them), and each node
receives the ones none of its folders holds, from the lowest rank that holds each, into
``node-<g>/fetch-<n>/``. The load then runs as on one host, checking every file it reads
against the manifest's SHA-256.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch.distributed.checkpoint as torch_dcp

from parts.base.files import CheckpointError
from parts.comm import dcp_files, snapshot_net
from parts.comm import snapshot_files as files
from parts.comm.dcp import _files_read
from parts.comm.dcp_files import MANIFEST, METADATA
from parts.comm.dcp_steps import plain
from parts.comm.group import GroupInfo
from parts.comm.objects import all_gather_objects


@dataclass
class Net:
    """How the ranks of a ``Snapshots`` reach each other's files: the copy group, the node size,
    and the global rank of each group rank."""

    group: Any
    node_size: int
    ranks: list[int]


class Fetch:
    """One restore's view of where each file of each generation is whole, on every rank."""

    def __init__(self, job_dir: Path, info: GroupInfo, net: Net) -> None:
        self.job_dir, self.info, self.net = job_dir, info, net
        self.node = info.rank // net.node_size
        self.local = files.inventory(job_dir)
        listed = {g: {"snapshot": e["snapshot"], "names": e["names"],
                      "whole": {name: size for name, (_, size) in e["whole"].items()}}
                  for g, e in self.local.items()}
        self.every: list[dict] = all_gather_objects(listed, info.group)
        self.fetched_bytes = 0

    def generations(self) -> list[int]:
        """The generations whose every file is whole on some rank's host, newest first."""
        out = []
        for generation in sorted({g for theirs in self.every for g in theirs}, reverse=True):
            holders = [theirs[generation] for theirs in self.every if generation in theirs]
            held = {name for h in holders for name in h["whole"]}
            if set(holders[0]["names"]) <= held:
                out.append(generation)
        return out

    def entry(self, state: dict[str, Any], generation: int) -> dict:
        """Fetch what this rank's node lacks to load ``generation``: ``{"step", "world_size", "sources"}``."""
        folder = files.node_folder(self.job_dir, self.node) / f"fetch-{generation:08d}"
        snapshot = next(t[generation]["snapshot"] for t in self.every if generation in t)
        pair = min(r for r, t in enumerate(self.every) if {METADATA, MANIFEST} <= set(self._whole(r, generation)))
        nodes = range(self.info.world_size // self.net.node_size)
        self._run(generation, self._plan(generation, {n: {METADATA, MANIFEST} for n in nodes}, pair), folder)
        sources = self._sources(generation, folder, (METADATA, MANIFEST))
        wanted = self._reads(state, Path(sources[METADATA]))
        if snapshot.get("world_size") == self.info.world_size:
            wanted.add(files.side_name(self.info.rank))
        needs = all_gather_objects(sorted(wanted), self.info.group)
        size = self.net.node_size
        by_node = {n: {name for r in range(n * size, (n + 1) * size) for name in needs[r]} for n in nodes}
        self._run(generation, self._plan(generation, by_node, None), folder)
        return {**snapshot, "sources": self._sources(generation, folder, (METADATA, MANIFEST, *sorted(wanted)))}

    def _whole(self, rank: int, generation: int) -> dict[str, int]:
        """The files of ``generation`` whole on ``rank``'s host, with their sizes."""
        return self.every[rank].get(generation, {}).get("whole", {})

    def _reads(self, state: dict[str, Any], folder: Path) -> set[str]:
        """The files this rank's load of ``state`` reads, from the generation's metadata in ``folder``."""
        metadata = dcp_files.read_metadata(folder)
        planner = torch_dcp.DefaultLoadPlanner(allow_partial_load=False)
        planner.set_up_planner(plain(state), metadata, self.info.rank == 0)
        return set(_files_read(planner.create_local_plan(), metadata))

    def _sources(self, generation: int, folder: Path, names: tuple) -> dict[str, str]:
        """Where each of ``names`` is on this host: a committed copy, else the fetch folder."""
        mine = self.local.get(generation, {}).get("whole", {})
        return {name: mine[name][0] if name in mine else str(folder) for name in names}

    def _plan(self, generation: int, wanted: dict[int, set], holder: Optional[int]) -> list[tuple[str, int, int]]:
        """(name, from rank, to rank) for each file a node wants and its leader's host lacks; from
        ``holder``, or the lowest rank whose host has the file whole."""
        moves = []
        for node, names in sorted(wanted.items()):
            leader = node * self.net.node_size
            for name in sorted(names - set(self._whole(leader, generation))):
                src = holder if holder is not None else next(
                    (r for r in range(len(self.every)) if name in self._whole(r, generation)), None)
                if src is None:
                    raise CheckpointError(f"snapshot generation {generation} of {self.job_dir}: no rank holds "
                                          f"{name}", path=self.job_dir)
                moves.append((name, src, leader))
        return moves

    def _run(self, generation: int, moves: list, folder: Path) -> None:
        """Each move (name, from rank, to rank) in order, this rank's part of it; then every rank waits."""
        for name, src, dst in moves:
            size = self.every[src][generation]["whole"][name]
            if self.info.rank == src:
                path = Path(self.local[generation]["whole"][name][0]) / name
                snapshot_net.send_file(self.net.group, self.net.ranks[dst], path, size)
            elif self.info.rank == dst:
                snapshot_net.recv_file(self.net.group, self.net.ranks[src], folder / name, size)
                self.fetched_bytes += size
        all_gather_objects(None, self.info.group)  # a node's fetched files are there for all its ranks

    def clear(self) -> None:
        """A node's leader: remove what the restore fetched into the node's folder."""
        if self.info.rank % self.net.node_size == 0:
            for child in files.node_folder(self.job_dir, self.node).glob("fetch-*"):
                shutil.rmtree(child, ignore_errors=True)
