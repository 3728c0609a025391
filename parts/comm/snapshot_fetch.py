"""Restoring a snapshot on hosts that do not share memory (``parts.comm.Snapshots`` over the
network): the files a node lacks come from a rank that holds them.

Every rank lists, per committed generation, the files whole in the folders its host sees
(``snapshot_files.inventory``); the ranks exchange the lists, so each one knows the same
thing. A generation is a candidate while every file of it is whole on some host. To load one,
each node whose folders lack the ``.metadata`` and manifest the load follows (the lowest rank's
whole copy that names only files some host holds whole) receives that pair;
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
        listed = {g: {"snapshot": e["snapshot"], "names": e["names"], "metadata": e["metadata"],
                      "whole": {name: size for name, (_, size) in e["whole"].items()}}
                  for g, e in self.local.items()}
        self.every: list[dict] = all_gather_objects(listed, info.group)
        self.fetched_bytes = 0
        self._pairs: dict[int, Optional[int]] = {}

    def generations(self) -> list[int]:
        """The generations whose every file is whole on some rank's host, newest first; each
        with the lowest rank whose copy's ``.metadata`` and manifest are whole and name only
        files some host holds whole (the copy the load follows)."""
        out = []
        for generation in sorted({g for theirs in self.every for g in theirs}, reverse=True):
            held = {name for rank in range(len(self.every)) for name in self._whole(rank, generation)}
            self._pairs[generation] = next((rank for rank, theirs in enumerate(self.every)
                                            if {METADATA, MANIFEST} <= set(self._whole(rank, generation))
                                            and set(theirs[generation]["names"]) <= held), None)
            out += [generation] if self._pairs[generation] is not None else []
        return out

    def entry(self, state: dict[str, Any], generation: int) -> dict:
        """Fetch what this rank's node lacks to load ``generation``: ``{"step", "world_size", "sources"}``."""
        folder = files.node_folder(self.job_dir, self.node) / f"fetch-{generation:08d}"
        snapshot = next(t[generation]["snapshot"] for t in self.every if generation in t)
        nodes, pair = range(self.info.world_size // self.net.node_size), self._pairs[generation]
        followed = self._metadata(pair, generation)
        self._run(generation, [(name, pair, node * self.net.node_size) for node in nodes
                               if self._metadata(node * self.net.node_size, generation) != followed
                               for name in (METADATA, MANIFEST)], folder)
        own = self._metadata(self.node * self.net.node_size, generation) == followed
        sources = {name: self.local[generation]["whole"][name][0] if own else str(folder)
                   for name in (METADATA, MANIFEST)}
        wanted = self._reads(state, Path(sources[METADATA]))
        if snapshot.get("world_size") == self.info.world_size:
            wanted.add(files.side_name(self.info.rank))
        needs = all_gather_objects(sorted(wanted), self.info.group)
        size = self.net.node_size
        by_node = {n: {name for r in range(n * size, (n + 1) * size) for name in needs[r]} for n in nodes}
        self._run(generation, self._plan(generation, by_node), folder)
        return {**snapshot, "sources": {**self._sources(generation, folder, tuple(sorted(wanted))), **sources}}

    def _metadata(self, rank: int, generation: int) -> Optional[dict]:
        """The size and SHA-256 of the ``.metadata`` whole on ``rank``'s host (None if none)."""
        return self.every[rank].get(generation, {}).get("metadata")

    def _whole(self, rank: int, generation: int) -> dict[str, int]:
        """The files of ``generation`` whole on ``rank``'s host, with their sizes."""
        return self.every[rank].get(generation, {}).get("whole", {})

    def _reads(self, state: dict[str, Any], folder: Path) -> set[str]:
        """The files this rank's load of ``state`` reads, from the generation's metadata in ``folder``."""
        try:
            metadata = dcp_files.read_metadata(folder)
            planner = torch_dcp.DefaultLoadPlanner(allow_partial_load=False)
            planner.set_up_planner(plain(state), metadata, self.info.rank == 0)
            return set(_files_read(planner.create_local_plan(), metadata))
        except Exception:  # noqa: BLE001 - the load that follows raises it on every rank, naming the file
            return set()

    def _sources(self, generation: int, folder: Path, names: tuple) -> dict[str, str]:
        """Where each of ``names`` is on this host: a committed copy, else the fetch folder."""
        mine = self.local.get(generation, {}).get("whole", {})
        return {name: mine[name][0] if name in mine else str(folder) for name in names}

    def _plan(self, generation: int, wanted: dict[int, set]) -> list[tuple[str, int, int]]:
        """(name, from rank, to rank) for each file a node wants and its leader's host lacks, from
        the lowest rank whose host has the file whole."""
        moves = []
        for node, names in sorted(wanted.items()):
            leader = node * self.net.node_size
            for name in sorted(names - set(self._whole(leader, generation))):
                src = next((r for r in range(len(self.every)) if name in self._whole(r, generation)), None)
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
