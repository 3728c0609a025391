"""DCP's save steps, each agreed across the ranks, shared by ``dcp.save`` and ``dcp.async_save``.

``Ranks`` runs a step on every rank and raises ``CheckpointError`` on every rank if it failed on
any; ``plan_save`` agrees the plans and metadata; ``write_local`` writes this rank's files (local
IO, no collective, so a background thread may run it); ``finish_save`` writes the metadata and
commits the transaction on rank 0.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from parts.base.files import CheckpointError
from parts.comm import dcp_files as files
from parts.comm.agree import all_gather_agreed, broadcast_agreed
from parts.comm.failure import Failure, describe
from parts.comm.group import GroupArg, group_info


class Ranks:
    """The group, and DCP's steps agreed across it: if any rank's part of a step raised, every
    rank raises ``CheckpointError`` naming the checkpoint, the step, the ranks and their errors."""

    def __init__(self, group: GroupArg, action: str, where: Any) -> None:
        info = group_info(group, f"parts.comm.dcp.{action}")
        self.info, self.rank, self.action, self.where = info, info.rank, action, where
        self.is_coordinator = self.rank == 0

    def error(self, step: str) -> Callable[[Mapping[int, Failure]], CheckpointError]:
        """What every rank raises when ``step`` failed on some ranks."""
        def make(failures: Mapping[int, Failure]) -> CheckpointError:
            ours = all(f.error.startswith(f"{CheckpointError.__name__}:") for f in failures.values())
            return CheckpointError(
                f"checkpoint {self.action} of {self.where} failed at its {step} step on rank(s) "
                f"{sorted(failures)}:\n{describe(failures, tracebacks=not ours)}",
                path=self.where, failures={r: f.error for r, f in failures.items()})
        return make

    def central(self, step: str, local: Callable[[], Any], reduce: Callable[[list], Any]) -> Any:
        """``reduce`` (on rank 0) of every rank's ``local()``, broadcast to every rank."""
        every = all_gather_agreed(local, self.info, self.error(step))
        return broadcast_agreed(lambda: reduce(every), 0, self.info, self.error(step))

    def on_coordinator(self, step: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on rank 0, its result on every rank."""
        return broadcast_agreed(fn, 0, self.info, self.error(step))


def accepts_kwargs(method: Callable) -> bool:
    return "kwargs" in inspect.signature(method).parameters


def plain(state_dict: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state_dict.items()}


def target(checkpoint_id: Any, storage: Any, kind: type) -> Optional[Path]:
    """The local directory the checkpoint is, if it is one (a path, or the file-system
    writer's/reader's own); None for other storage."""
    if storage is not None and not isinstance(storage, kind):
        return None
    where = checkpoint_id if checkpoint_id is not None else getattr(storage, "path", None)
    return Path(where) if isinstance(where, (str, os.PathLike)) else None


def plan_save(plain: Callable[[], dict[str, Any]], ranks: Ranks, writer: dcp.StorageWriter,
              planner: Optional[dcp.SavePlanner]) -> tuple[dcp.SavePlanner, list, dcp.Metadata]:
    """DCP's planning step, agreed: the planner, every rank's final plan and (on rank 0) the
    checkpoint's metadata. ``plain()`` (the state dict DCP sees) runs inside the agreed step."""
    planner = planner or dcp.DefaultSavePlanner()
    metadata = []

    def local_plan() -> Any:
        planner.set_up_planner(plain(), writer.storage_meta(), ranks.is_coordinator)
        if accepts_kwargs(writer.set_up_storage_writer):
            writer.set_up_storage_writer(ranks.is_coordinator, rank=ranks.rank, use_collectives=True)
        else:
            writer.set_up_storage_writer(ranks.is_coordinator)
        return writer.prepare_local_plan(planner.create_local_plan())

    def global_plan(plans: list) -> list:
        plans, meta = planner.create_global_plan(plans)
        metadata.append(meta)
        return writer.prepare_global_plan(plans)

    plans = ranks.central("plan", local_plan, global_plan)
    return planner, plans, (metadata[0] if metadata else None)


def write_local(writer: dcp.StorageWriter, planner: dcp.SavePlanner, plan: Any,
                staged: Optional[tuple[Path, Path]], rank: int) -> tuple[list, dict]:
    """This rank's files of the checkpoint: DCP's write results and (into a staging folder)
    each file's digest. Local file IO only: no collective."""
    try:
        futures = writer.write_data(planner.finish_plan(plan), planner)
        futures.wait()
        results = futures.value()
    except Exception as exc:
        if staged:  # name the files: an OSError of torch's serializer names none
            raise files.write_failed(staged[0], rank, exc) from exc
        raise
    return results, (files.digests(staged[0], files.written_files(results)) if staged else {})


def finish_save(writer: dcp.StorageWriter, metadata: dcp.Metadata, every: list,
                staged: Optional[tuple[Path, Path]]) -> dcp.Metadata:
    """Rank 0, once every rank wrote (``every``: their ``write_local`` results): DCP's metadata,
    then, into a directory, the manifest and the commit."""
    writer.finish(metadata=metadata, results=[results for results, _ in every])
    if staged:
        files.seal(staged[0], {name: d for _, digests in every for name, d in digests.items()})
        files.commit(*staged)
    return metadata


def writer(writer: Optional[dcp.StorageWriter], checkpoint_id: Any, deferred: bool) -> dcp.StorageWriter:
    if writer is None:
        return dcp.FileSystemWriter(checkpoint_id, single_file_per_rank=not deferred)
    if checkpoint_id is not None:
        writer.reset(checkpoint_id)
    return writer
