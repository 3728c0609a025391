"""``torch.distributed.checkpoint`` (DCP) for parts: ``save`` and ``load`` that coordinate
ranks without numpy, agree on every failure, and treat a checkpoint as a transaction. The
one module (with ``shard_view``, ``dcp_files`` and ``dcp_steps``) that imports DCP.

``save``/``load`` run DCP's own steps (planner, storage writer/reader, metadata: the files
are exactly what ``dcp.save`` writes and ``dcp.load`` reads, and the other way round), but
exchange the plans through ``parts.comm.objects`` instead of torch's object collectives,
which need numpy (absent in a fresh environment). Each step is agreed
(``parts.comm.agree``): if it failed on any rank, every rank raises ``CheckpointError``
naming the checkpoint, the failing ranks and their errors, and no rank goes on.

Into a directory (``checkpoint_id``, or a ``FileSystemWriter``'s path) a save is a
transaction (``parts.comm.dcp_files``): written into ``<path>.saving``, every file fsynced
and listed with its size and SHA-256 in ``parts_manifest.json``, checked, then moved into
place; the previous checkpoint's files at ``path`` are removed only then, so a failed save (a
full disk) leaves it intact, and no other file of ``path`` is touched, nor a folder beside it
that the save did not make (a user's ``<path>.old`` backup). A load checks each
file it reads against the manifest, reads ``.metadata`` without running code from it, and
(``strict``, the default) refuses a state dict whose keys differ from the checkpoint's, naming
the missing and unexpected keys.

``async_save`` (``parts.comm.async_save``) returns once this rank's state is copied to host
memory and writes and commits the same transaction in a background thread; ``wait()`` on the
``AsyncSave`` it returns (or the next ``async_save``) raises its error.

``ShardView`` (``parts.comm.shard_view``): the storage-less view of this rank's pieces of a
global tensor that DCP saves from and loads into; ``settle`` gives deferred (stored)
segments back to their store, as ``save``/``load`` do when they finish.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.stateful import Stateful

from parts.base.files import CheckpointError as CheckpointError
from parts.comm import dcp_files as files
from parts.comm.async_save import async_save as start_async_save
from parts.comm.dcp_steps import Ranks as _Ranks
from parts.comm.dcp_steps import accepts_kwargs as _accepts_kwargs
from parts.comm.dcp_steps import finish_save, plan_save, write_local
from parts.comm.dcp_steps import plain as _plain
from parts.comm.dcp_steps import target as _target
from parts.comm.dcp_steps import writer as _writer
from parts.comm.group import GroupArg
from parts.comm.shard_view import ShardView as ShardView
from parts.comm.shard_view import has_deferred
from parts.comm.shard_view import is_deferred as is_deferred
from parts.comm.shard_view import same_piece as same_piece
from parts.comm.shard_view import settle as settle


def save(state_dict: dict[str, Any], *, checkpoint_id: Any = None,
         storage_writer: Optional[dcp.StorageWriter] = None, planner: Optional[dcp.SavePlanner] = None,
         group: GroupArg = None) -> dcp.Metadata:
    """``dcp.save`` without numpy, agreed across ranks, committed as a transaction into a directory.

    The checkpoint at ``checkpoint_id`` is replaced only once the new one is complete and
    verified; on any failure every rank raises ``CheckpointError`` and the old one is intact.
    With deferred segments (shards in a ``DiskStore``) and no ``storage_writer``, DCP's
    ``FileSystemWriter`` writes one file per item (``single_file_per_rank=False``): with one
    file per rank it would hold every item it wrote until the file is closed."""
    if checkpoint_id is None and storage_writer is None:
        raise ValueError("parts.comm.dcp.save: give checkpoint_id (a directory) or a storage_writer")
    target = _target(checkpoint_id, storage_writer, dcp.FileSystemWriter)
    ranks = _Ranks(group, "save", target if target is not None else checkpoint_id)
    deferred = has_deferred(state_dict)
    try:
        if target is None:
            return _save(state_dict, ranks, _writer(storage_writer, checkpoint_id, deferred), planner, None)
        staging = ranks.on_coordinator("prepare", lambda: files.begin(target))
        try:
            writer = _writer(storage_writer, staging, deferred)
            return _save(state_dict, ranks, writer, planner, (staging, target))
        except Exception:
            if ranks.is_coordinator:  # every rank is past its writes: the step was agreed
                files.abandon(staging)
            raise
    finally:
        if storage_writer is not None and target is not None:
            storage_writer.reset(target)  # the writer names the checkpoint, not its staging
        settle(state_dict)


def _save(state_dict: dict[str, Any], ranks: _Ranks, writer: dcp.StorageWriter,
          planner: Optional[dcp.SavePlanner], staged: Optional[tuple[Path, Path]]) -> dcp.Metadata:
    """DCP's save steps, agreed; with ``staged`` (staging, target) sealed and committed."""
    planner, plans, metadata = plan_save(lambda: _plain(state_dict), ranks, writer, planner)
    return ranks.central("write", lambda: write_local(writer, planner, plans[ranks.rank], staged, ranks.rank),
                         lambda every: finish_save(writer, metadata, every, staged))


def load(state_dict: dict[str, Any], *, checkpoint_id: Any = None,
         storage_reader: Optional[dcp.StorageReader] = None, planner: Optional[dcp.LoadPlanner] = None,
         group: GroupArg = None, strict: bool = True) -> None:
    """``dcp.load`` without numpy: tensors (ShardViews too) are filled in place, other values replaced.

    Every file read is checked against the checkpoint's manifest first; with ``strict`` the
    state dict's keys must be the checkpoint's (``strict=False`` loads the keys both have).
    On any failure every rank raises ``CheckpointError`` naming the rank and the file."""
    if checkpoint_id is None and storage_reader is None:
        raise ValueError("parts.comm.dcp.load: give checkpoint_id (a directory) or a storage_reader")
    target = _target(checkpoint_id, storage_reader, dcp.FileSystemReader)
    ranks = _Ranks(group, "load", target if target is not None else checkpoint_id)
    manifest = ranks.on_coordinator("open", lambda: files.open_checkpoint(target)) \
        if target is not None else None
    reader = _reader(storage_reader, checkpoint_id)
    planner = planner or dcp.DefaultLoadPlanner(allow_partial_load=not strict)
    keys = sorted(state_dict)
    plain = _plain(state_dict)

    def local_plan() -> Any:
        metadata = _metadata(reader, target)
        planner.set_up_planner(plain, metadata, ranks.is_coordinator)
        if strict:
            _check_keys(getattr(planner, "state_dict", None), metadata, ranks.where)
        if _accepts_kwargs(reader.set_up_storage_reader):
            reader.set_up_storage_reader(metadata, ranks.is_coordinator, rank=ranks.rank, use_collectives=True)
        else:
            reader.set_up_storage_reader(metadata, ranks.is_coordinator)
        plan = planner.create_local_plan()
        if target is not None:
            files.verify_reads(target, manifest, _files_read(plan, metadata))
        return reader.prepare_local_plan(plan)

    plans = ranks.central("plan", local_plan, lambda plans: reader.prepare_global_plan(
        planner.create_global_plan(plans)))
    try:
        ranks.central("read", lambda: reader.read_data(planner.finish_plan(plans[ranks.rank]), planner).wait(),
                      lambda results: None)
    finally:
        settle(state_dict)  # the last stored tensor DCP wrote into goes back to its store
    for k in keys:
        if isinstance(state_dict[k], Stateful):
            state_dict[k].load_state_dict(plain[k])
        else:
            state_dict[k] = plain[k]


def _metadata(reader: dcp.StorageReader, target: Optional[Path]) -> dcp.Metadata:
    """The checkpoint's metadata: from a directory without running code (``dcp_files``), else
    as the reader reads it; the reader's load id stamped on it, as ``FileSystemReader`` does."""
    if target is None:
        return reader.read_metadata()
    metadata = files.read_metadata(target)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = getattr(reader, "load_id", None)
    return metadata


def _check_keys(requested: Any, metadata: dcp.Metadata, where: Any) -> None:
    """Raise naming the keys only one of the state dict (flattened, as DCP names them) and the checkpoint has."""
    if not isinstance(requested, Mapping):
        return
    saved = set(metadata.state_dict_metadata)
    missing, unexpected = sorted(set(requested) - saved), sorted(saved - set(requested))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {where} does not hold the state dict's keys (strict=False loads the keys "
            f"both have): missing keys (in the state dict, not in the checkpoint): {missing}; "
            f"unexpected keys (in the checkpoint, not in the state dict): {unexpected}", path=where)


def _files_read(plan: Any, metadata: dcp.Metadata) -> set[str]:
    """The checkpoint files a load plan reads from."""
    names = set()
    for item in plan.items:
        name = getattr(metadata.storage_data.get(item.storage_index), "relative_path", None)
        if isinstance(name, str):
            names.add(name)
    return names


def _reader(reader: Optional[dcp.StorageReader], checkpoint_id: Any) -> dcp.StorageReader:
    if reader is None:
        return dcp.FileSystemReader(checkpoint_id)
    if checkpoint_id is not None:
        reader.reset(checkpoint_id)
    return reader


def async_save(state_dict: dict[str, Any], *, checkpoint_id: Any = None,
               storage_writer: Optional[dcp.StorageWriter] = None, planner: Optional[dcp.SavePlanner] = None,
               group: GroupArg = None) -> Any:
    """``save`` that returns once this rank's state is copied to host memory and writes and
    commits in a background thread; returns an ``AsyncSave`` (``wait()``, ``result()``, ``done()``).

    A second ``async_save`` waits for the previous one and raises its error if it failed, as
    ``wait()`` does; see ``parts.comm.async_save``."""
    return start_async_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                            planner=planner, group=group)
