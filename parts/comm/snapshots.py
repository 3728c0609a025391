"""``Snapshots``: training state in host memory that outlives the worker processes, held by a
buddy node too, restored by the workers torchrun's agent restarts.

A snapshot is a DCP checkpoint of the caller's state dict (what ``parts.comm.dcp.save`` takes:
sharded weights, optimizer state with owner-held whole-path state, schedules), plus each
rank's RNG states and a value of its own (a data position), written as files under
``/dev/shm`` (``snapshot_files`` has the layout). ``save`` holds the loop for the host copy of
the state and DCP's planning (as ``dcp.async_save`` does); a background thread writes this
rank's files into its node's folder and copies them into its buddy node's, the ranks report
through the default store, and each node's leader commits the node's copy of the generation
with one rename. ``restore`` (``snapshot_restore``) loads the newest generation whose every
file is whole in some node's folder, resharding when the world changed.

Nodes are ``node_size`` consecutive ranks (default ``LOCAL_WORLD_SIZE``); node ``g``'s buddy
is node ``(g + 1) % nodes``. Where every rank sees the folder group rank 0 made (one host's
memory), a rank copies its files into the buddy node's folder; where some do not (hosts with
memory of their own), each node's ranks share their own root, and a rank sends its files to its
buddy rank (the same local rank on the buddy node) over a gloo group made for the copies
(``snapshot_net``), which writes them into its node's folder; a restore moves the files a node
lacks the same way (``snapshot_fetch``). Where each node's ranks hold the whole state (a hybrid
layout whose replicas are the nodes), each node's copy is a checkpoint of its own
(``snapshot_plan``) and only each rank's own values go to the buddy. Host memory holds at most
two generations per node (the last committed everywhere and the one being written or just
written, each with the buddy's files), and one host copy of the rank's state, reused from save
to save.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as torch_dcp

from parts.base.files import CheckpointError, file_digest
from parts.comm import dcp_steps as steps
from parts.comm import snapshot_files as files
from parts.comm import snapshot_net
from parts.comm.failure import Failure, attempt, failures_in
from parts.comm.group import GroupArg, GroupInfo, group_info
from parts.comm.host_copy import HostCopy
from parts.comm.objects import all_gather_objects
from parts.comm.shard_view import ShardView, settle
from parts.comm.snapshot_fetch import Net
from parts.comm.snapshot_plan import NodePlanner
from parts.comm.snapshot_restore import Restored, restore, rng_state
from parts.comm.store_gather import StoreGather


class Snapshots:
    """Snapshots of the training state in host memory every ``every`` steps (see the module
    docstring). Collective: every rank of ``group`` makes it and calls each method.

    ``job`` names the folder (default: torchrun's ``TORCHELASTIC_RUN_ID``, the same in every
    restart of the job; without it, one drawn per start). ``root`` defaults to ``/dev/shm``; the
    ranks of one node must see the same ``root`` folder, and nodes that do not see group rank 0's
    send their copies over the network (``network`` is then True)."""

    def __init__(self, every: int, *, job: Optional[str] = None, root: Optional[os.PathLike] = None,
                 node_size: Optional[int] = None, group: GroupArg = None) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"parts.comm.Snapshots: every must be a positive number of steps, not {every!r}")
        self.every, self.job, self.group = every, job, group
        self.root = Path(root) if root is not None else files.default_root()
        self.node_size = node_size
        self.reclaimed_bytes = 0
        self.saves = 0
        self.save_seconds = 0.0  # time the save calls held the loop, in total
        self.thread_seconds = 0.0  # CPU time the background threads took, in total
        self._info = None
        self._net: Optional[Net] = None
        self.network = False  # nodes without a shared root: buddy copies and restores over the network
        self.sent_bytes = 0  # bytes of buddy copies sent over the network, in total
        self.node_checkpoints = False  # each node's copy a whole checkpoint: DCP files get no buddy copy
        self._host = HostCopy()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._committed: Optional[int] = None
        self._plans: Optional[tuple[list, list, Any]] = None  # every rank's state signature, plans, metadata

    # ------------------------------------------------------------ setup
    def start(self) -> "Snapshots":
        """Agree on the job's folder, the next generation and whether the nodes share a root;
        claim the folder (on each host), reclaim dead jobs'."""
        if self._info is not None:
            return self
        info = group_info(self.group, "parts.comm.Snapshots")
        size = self.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
        if size < 1 or info.world_size % size:
            raise ValueError(f"parts.comm.Snapshots: node_size {size} does not divide the group's "
                             f"{info.world_size} ranks (node_size, or LOCAL_WORLD_SIZE)")
        job = self.job or os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex
        jobs = all_gather_objects((job, uuid.uuid4().hex), info.group)
        self.job_dir, self._token = files.job_folder(self.root, jobs[0][0]), jobs[0][1]
        self.node, self.nodes, self.node_ranks = info.rank // size, info.world_size // size, size
        self.leader = info.rank % size == 0
        self.network = self._claim(info)
        highest = all_gather_objects(self._highest_generation(), info.group)
        if self.leader:
            files.node_folder(self.job_dir, self.node).mkdir(parents=True, exist_ok=True)
            files.clear_staging(files.node_folder(self.job_dir, self.node))
        self._next = max(highest) + 1
        self._net = Net(snapshot_net.copy_group(info), size, info.global_ranks()) if self.network else None
        self._info = info
        all_gather_objects(None, info.group)  # no rank saves before every leader cleared its staging
        return self

    def _claim(self, info: GroupInfo) -> bool:
        """Make and claim the job's folder: rank 0's, seen by every rank (one host's memory:
        False), or where some ranks do not see it, each node leader's on its own host (True);
        every rank must see its node leader's folder."""
        marker = self.job_dir / f"start-{self._token}"
        if info.rank == 0:
            self._claim_folder()
            marker.touch()
        all_gather_objects(None, info.group)  # rank 0 made its marker before any rank looks
        seen = all_gather_objects(marker.is_file(), info.group)
        if all(seen):
            if info.rank == 0:
                marker.unlink()
            return False
        own = self.job_dir / f"start-{self._token}-node-{self.node}"
        if self.leader:
            if not seen[info.rank]:
                self._claim_folder()
            own.touch()
        all_gather_objects(None, info.group)  # every leader made its marker before any rank looks
        seen_own = all_gather_objects(own.is_file(), info.group)
        if self.leader:
            own.unlink()
        if info.rank == 0:
            marker.unlink()
        _check_shared(seen_own, self.job_dir, self.node_ranks)
        return True

    def _claim_folder(self) -> None:
        """Claim the job's folder on this host for the process that outlives the workers; reclaim dead jobs'."""
        agent = bool(os.environ.get("TORCHELASTIC_RUN_ID"))  # the agent outlives the workers
        files.claim(self.job_dir, os.getppid() if agent else os.getpid(), replace_orphaned=agent and not self.job)
        self.reclaimed_bytes = files.reclaim(self.root, keep=self.job_dir)

    def _highest_generation(self) -> int:
        """The highest generation number in the job's folders this rank sees (0 if none)."""
        found = [0]
        for node in self.job_dir.glob("node-*"):
            for gen in node.glob("gen-*"):
                digits = gen.name[4:12]
                found += [int(digits)] if digits.isdigit() else []
        return max(found)

    # ------------------------------------------------------------ saving
    def due(self, step: int) -> bool:
        """True when ``step`` is one a snapshot is taken at (a multiple of ``every``)."""
        return step % self.every == 0

    def save(self, state: dict[str, Any], step: int, local: Any = None) -> None:
        """Snapshot ``state`` (a DCP state dict) at ``step``, with this rank's RNG states and
        ``local`` (tensors, numbers, strings and containers of them: a data position).

        Returns once the state is in host memory; raises the previous snapshot's error if it failed."""
        began = time.perf_counter()
        self.start()
        self.wait()
        info = self._info
        if self.leader and self._committed is not None:
            files.prune(files.node_folder(self.job_dir, self.node), self._committed)
        generation, self._next = self._next, self._next + 1
        staging = files.begin(self.job_dir, self.node, generation)
        writer = torch_dcp.FileSystemWriter(staging, sync_files=False)
        ranks = steps.Ranks(self.group, "snapshot", staging)
        side = {"rng": rng_state(), "local": local, "rank": info.rank, "step": step}
        try:
            planner, plans, metadata = self._plan(state, ranks, writer)
        finally:
            settle(state)
        job = _Job(self, generation, step, staging, writer, planner, plans[info.rank], metadata, side,
                   f"{self._token}/{generation}")
        self._thread = threading.Thread(target=job.run, name="parts-snapshot", daemon=True)
        self._thread.start()
        self.saves += 1
        self.save_seconds += time.perf_counter() - began

    def _plan(self, state: dict[str, Any], ranks: steps.Ranks, writer: Any) -> tuple[Any, list, Any]:
        """The host copy of ``state`` and DCP's plans for it: agreed anew only where some rank's
        state changed its structure since the last save (one small exchange otherwise)."""
        host = attempt(lambda: self._host.take(steps.plain(state)), ranks.rank)[0]
        every = all_gather_objects(host if isinstance(host, Failure) else _signature(host), ranks.info.group)
        failed = failures_in(every)
        if failed:
            raise ranks.error("copy")(failed)
        if self._plans is None or every != self._plans[0]:
            node_planner = NodePlanner(self.node_ranks) if self.nodes > 1 else None
            planner, plans, metadata = steps.plan_save(lambda: host, ranks, writer, node_planner)
            metadata = getattr(planner, "node_metadata", None) or metadata  # rank 0: one per node
            self.node_checkpoints = all_gather_objects(isinstance(metadata, list), ranks.info.group)[0]
            self._plans = (every, plans, metadata)
            return planner, plans, metadata
        planner = torch_dcp.DefaultSavePlanner()
        planner.set_up_planner(host, writer.storage_meta(), ranks.is_coordinator)
        writer.set_up_storage_writer(ranks.is_coordinator, rank=ranks.rank, use_collectives=True)
        return planner, self._plans[1], self._plans[2]

    def wait(self) -> None:
        """Wait for the snapshot being written; raise its error (once) if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    @property
    def generation(self) -> Optional[int]:
        """The newest generation committed on every node by this object (None before the first)."""
        return self._committed

    # ------------------------------------------------------------ restoring and ending
    def restore(self, state: dict[str, Any]) -> Optional[Restored]:
        """Load the newest snapshot of this job into ``state``; None if there is none (see
        ``parts.comm.snapshot_restore``). RNG states come back where the world is the same."""
        self.start()
        restored = restore(state, self.job_dir, self._info, self._net)
        if restored is not None:
            self._committed = restored.generation
        return restored

    def close(self) -> None:
        """A clean finish: wait for the last snapshot, then remove the job's folders on every node."""
        if self._info is None:
            return
        try:
            self.wait()
        finally:
            all_gather_objects(None, self._info.group)
            if self.leader:
                shutil.rmtree(files.node_folder(self.job_dir, self.node), ignore_errors=True)
            all_gather_objects(None, self._info.group)
            if self.leader:
                shutil.rmtree(self.job_dir, ignore_errors=True)
            all_gather_objects(None, self._info.group)  # gone on every node once close returns
            self._host.release()
            self._info = None

    def __enter__(self) -> "Snapshots":
        return self.start()

    def __exit__(self, kind: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if exc is None:
            self.close()  # a run that fails keeps its snapshots for the restarted workers


class _Job:
    """One snapshot's background work on one rank: write, copy to the buddy, report, commit."""

    def __init__(self, owner: Snapshots, generation: int, step: int, staging: Path, writer: Any, planner: Any,
                 plan: Any, metadata: Any, side: dict, token: str) -> None:
        self.owner, self.generation, self.step, self.staging = owner, generation, step, staging
        self.writer, self.planner, self.plan, self.metadata, self.side = writer, planner, plan, metadata, side
        self.info = owner._info
        self.writes = StoreGather(f"parts/snapshots/{token}/write", self.info)
        self.commits = StoreGather(f"parts/snapshots/{token}/commit", self.info)

    def run(self) -> None:
        """The thread: the outcome lands in the owner (``_committed``, or ``_error``)."""
        began = time.thread_time()
        try:
            mine = attempt(self._write, self.info.rank)[0]
            verdict = self.writes.gather_decide(mine, self._decide)
            if not isinstance(verdict, tuple):
                raise self._error_of("write", verdict)
            committed = attempt(lambda: self._commit(*verdict), self.info.rank)[0] if self.owner.leader else None
            failed = self.commits.gather_decide(committed, failures_in)
            if failed:
                raise self._error_of("commit", failed)
            self.owner._committed = self.generation
        except BaseException as exc:  # noqa: BLE001 - surfaces on the next save, wait() or close()
            self.owner._error = exc if isinstance(exc, CheckpointError) else CheckpointError(
                f"snapshot {self.generation} of {self.owner.job_dir} failed on rank {self.info.rank}: "
                f"{type(exc).__name__}: {exc}", path=self.owner.job_dir)
        finally:
            self.owner.thread_seconds += time.thread_time() - began

    def _write(self) -> tuple[list, dict]:
        """This rank's DCP files and own values in its node's staging folder, and in its buddy's."""
        results, digests = steps.write_local(self.writer, self.planner, self.plan, (self.staging, None),
                                             self.info.rank)
        side = files.side_name(self.info.rank)
        torch.save(self.side, self.staging / side)
        digests = {**digests, side: file_digest(self.staging / side)}
        owner = self.owner
        copied = [side] if owner.node_checkpoints else sorted(digests)
        if owner._net is not None:  # the buddy rank: this local rank of the next node
            ranks, world = owner._net.ranks, self.info.world_size
            owner.sent_bytes += snapshot_net.exchange(
                owner._net.group, ranks[(self.info.rank + owner.node_ranks) % world],
                ranks[(self.info.rank - owner.node_ranks) % world], copied, self.staging, self.staging)
        elif owner.nodes > 1:
            buddy = (owner.node + 1) % owner.nodes
            files.copy_files(self.staging, copied, files.begin(owner.job_dir, buddy, self.generation))
        return results, digests

    def _decide(self, every: list) -> Any:
        """Rank 0: the failures, or (metadata, every rank's results, every file's digest, files by rank)."""
        failed = failures_in(every)
        if failed:
            return failed
        digests = {name: d for _, mine in every for name, d in mine.items()}
        return self.metadata, [results for results, _ in every], digests, [sorted(mine) for _, mine in every]

    def _commit(self, metadata: Any, results: list, digests: dict, by_rank: list) -> None:
        """A node's leader: DCP's metadata and the manifest in the node's copy, then the rename.
        With one metadata per node, the copy holds the node's own DCP files and every rank's values."""
        owner, size = self.owner, self.owner.node_ranks
        holds = {owner.node, (owner.node - 1) % owner.nodes}
        expected = [name for rank, names in enumerate(by_rank) if rank // size in holds for name in names]
        if isinstance(metadata, list):
            own = range(owner.node * size, (owner.node + 1) * size)
            sides = {files.side_name(rank) for rank in range(len(by_rank))}
            metadata, results = metadata[owner.node], [results[rank] for rank in own]
            digests = {name: d for name, d in digests.items()
                       if name in sides or any(name in by_rank[rank] for rank in own)}
            expected = [name for name in expected if name in digests]  # the predecessor's values only
        self.writer.finish(metadata=metadata, results=results)
        info = {"generation": self.generation, "step": self.step, "world_size": self.info.world_size,
                "node_size": size}
        files.commit(self.staging, digests, expected, info)

    def _error_of(self, step: str, failed: Any) -> CheckpointError:
        if isinstance(failed, Failure):
            failed = {0: failed}
        return steps.Ranks(self.owner.group, "snapshot", self.owner.job_dir).error(step)(failed)


def _signature(state: Any) -> str:
    """A digest of what DCP's plans depend on: keys, shapes, dtypes, shard pieces, value types."""
    parts: list = []

    def walk(value: Any, path: tuple) -> None:
        if isinstance(value, ShardView):
            parts.append((path, tuple(value.shape), str(value.dtype), [(a, p.numel()) for a, p in value.segments]))
        elif isinstance(value, torch.Tensor):
            parts.append((path, tuple(value.shape), str(value.dtype)))
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, path + (key,))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, path + (i,))
        else:
            parts.append((path, type(value).__name__))
    walk(state, ())
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _check_shared(every: list, job_dir: Path, node_size: int) -> None:
    """Raise on every rank unless each one sees the folder its node's leader made."""
    blind = [rank for rank, seen in enumerate(every) if not seen]
    if blind:
        raise ValueError(f"parts.comm.Snapshots: group rank(s) {blind} do not see {job_dir}, which their node's "
                         f"first rank made: the ranks of one node ({node_size} consecutive ranks: node_size, or "
                         f"LOCAL_WORLD_SIZE) must see the same root folder")
