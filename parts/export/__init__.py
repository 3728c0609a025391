"""parts.export: a sharded DCP checkpoint to Hugging Face safetensors files, streamed, all or nothing.

    python -m parts.export CHECKPOINT_DIR OUT_DIR [--max-shard-size 5GB] [--dtype bfloat16] [--merge]

``export(checkpoint_dir, out_dir)`` reads a checkpoint written by ``parts.comm.dcp.save`` of
``sharded_state_dict(model)``, by ``torch.distributed.checkpoint.save`` or by FSDP2, at any world
size and however its tensors were split (or the one model checkpoint inside a parts Trainer's
``checkpoint-N/`` or an accelerate ``save_state`` folder), and writes ``model.safetensors`` (or
``model-0000i-of-0000n.safetensors`` files of at most ``max_shard_size`` bytes each and
``model.safetensors.index.json``), keyed by the checkpoint's keys, which ``from_pretrained``
and ``parts.partition.load_pretrained`` read. One process, no process group: each stored piece
(one rank's box of one tensor) is read, cast to ``dtype`` and written at its place in the
output file, then dropped, so the bytes held are those of the largest stored piece (about three
times it: the file's bytes, the loaded piece, its cast), whatever the model's size.
``config.json`` and ``generation_config.json`` are copied from the checkpoint directory (or its
parent, where ``parts.integrations.transformers.Trainer`` saves them beside ``parts_model/``).
A peft LoRA checkpoint is written as its adapter in peft's layout, or merged (``parts.export.peft``).
The files are written beside ``out_dir`` and moved in only when complete (``parts.export.output``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from parts.comm.dcp_read import CheckpointIndex, StoredTensor
from parts.export import peft
from parts.export.output import Staging, locate, refuse_into_checkpoint
from parts.export.safetensors import SafetensorsFile, plan_files

__all__ = ["export", "ExportResult", "parse_size", "INDEX", "CONFIG_FILES"]

INDEX = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class ExportResult:
    """What ``export`` wrote: the safetensors files, the index (None for one file), copied configs,
    tensors written, their bytes, the checkpoint's non-tensor keys left out, what it wrote
    (``model``, a peft ``adapter``, a ``merged`` model), the DCP checkpoint it read, and the
    earlier export's weight files it removed from the output folder."""

    files: list[Path]
    index: Optional[Path]
    configs: list[Path]
    tensors: int
    total_bytes: int
    skipped: list[str]
    kind: str = "model"
    checkpoint: Optional[Path] = None
    removed: list[Path] = dataclasses.field(default_factory=list)


def parse_size(size: Union[int, str]) -> int:
    """Bytes of ``5GB``, ``500MB``, ``2GiB`` or a plain int (transformers' ``max_shard_size`` spelling)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        if not found or found.group(2).upper() not in _UNITS:
            raise ValueError(f"export: max_shard_size {size!r} is not a size such as 5GB, 500MB or 1048576")
        value = int(float(found.group(1)) * _UNITS[found.group(2).upper()])
    if value <= 0:
        raise ValueError(f"export: max_shard_size must be > 0 bytes, got {size!r}")
    return value


def _out_dtype(stored: StoredTensor, dtype: Optional[torch.dtype]) -> torch.dtype:
    """``dtype`` for floating tensors (integers and flags keep theirs), else the stored dtype."""
    return dtype if dtype is not None and stored.dtype.is_floating_point else stored.dtype


def _names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def export(checkpoint_dir: Union[str, os.PathLike], out_dir: Union[str, os.PathLike], *,
           max_shard_size: Union[int, str] = "5GB", dtype: Optional[torch.dtype] = None,
           prefix: str = "", merge: bool = False) -> ExportResult:
    """Stream the DCP checkpoint at ``checkpoint_dir`` into safetensors files in ``out_dir``, all or nothing.

    ``checkpoint_dir`` may be a Trainer or accelerate checkpoint folder holding the model's DCP
    checkpoint. ``prefix``: export only the keys under it, without it (``"model"`` for a
    checkpoint saved as ``dcp.save({"model": state_dict})``). A peft LoRA model is exported as its
    adapter (``adapter_model.safetensors``, ``adapter_config.json``), or with ``merge`` as the
    plain model with the adapter merged."""
    given = Path(checkpoint_dir)
    checkpoint = locate(given)
    refuse_into_checkpoint(Path(out_dir), given, checkpoint)
    index = CheckpointIndex(checkpoint)
    items, kind, extra = _items(index, _selected(index, prefix), dtype, merge, [checkpoint, given, checkpoint.parent])
    plans = plan_files(((i.key, i.shape, i.dtype) for i in items),
                       parse_size(max_shard_size) if kind != "adapter" else sum(_nbytes(i) for i in items) + 1)
    names = [peft.ADAPTER_WEIGHTS] if kind == "adapter" else _names(len(plans))
    weight_map = {e.key: name for name, entries in zip(names, plans) for e in entries}
    total = sum(e.nbytes for entries in plans for e in entries)
    staging = Staging(Path(out_dir))
    try:
        staging.check_space(total)
        _write_files(staging.dir, names, plans, {i.key: i for i in items}, index)
        if len(plans) > 1:
            _write_index(staging.dir, weight_map, total)
        configs = [shutil.copyfile(path, staging.dir / path.name) for path in extra] if kind == "adapter" \
            else _copy_configs([checkpoint, given, checkpoint.parent], staging.dir)
        removed = staging.commit()
    except BaseException:
        staging.abandon()
        raise
    out = staging.out
    return ExportResult([out / n for n in names], out / INDEX if len(plans) > 1 else None,
                        [out / Path(c).name for c in configs], len(items), total, list(index.skipped),
                        kind, checkpoint, removed)


@dataclass(frozen=True)
class _Item:
    """A tensor of the output: its key, shape and dtype, and where its values come from (the
    stored tensor's pieces, or ``whole()`` computing the full tensor)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: StoredTensor
    whole: Optional[Callable[[], torch.Tensor]] = None


def _nbytes(item: _Item) -> int:
    return math.prod(item.shape) * item.dtype.itemsize


def _items(index: CheckpointIndex, tensors: list[StoredTensor], dtype: Optional[torch.dtype], merge: bool,
           folders: list[Path]) -> tuple[list[_Item], str, list[Path]]:
    """The output's tensors, its kind (``model``, ``adapter``, ``merged``) and extra files to copy."""
    by_key = {t.key: t for t in tensors}
    if not peft.is_peft(by_key):
        if merge:
            raise ValueError(f"export --merge: checkpoint {index.directory} holds no LoRA adapter (no "
                             f"lora_A / lora_B keys): nothing to merge; export it without --merge")
        return [_Item(t.key, t.shape, _out_dtype(t, dtype), t) for t in tensors], "model", []
    config = peft.find_config(folders)
    if not merge:
        chosen = [(peft.adapter_key(t.key), t) for t in tensors]
        return [_Item(k, t.shape, _out_dtype(t, dtype), t) for k, t in chosen if k], "adapter", [config]
    lora = peft.Lora.read(config)
    read = functools.partial(_read_full, index, by_key)
    items = []
    for key, pair in peft.merge_plan(by_key, lora).items():
        t = by_key[key]
        whole = peft.reader_of(read, lora, key, pair) if pair else None
        items.append(_Item(peft.merged_key(key), t.shape, _out_dtype(t, dtype), t, whole))
    return items, "merged", []


def _read_full(index: CheckpointIndex, by_key: dict[str, StoredTensor], key: str) -> torch.Tensor:
    """The whole stored tensor ``key``, assembled from its pieces."""
    stored = by_key[key]
    out = torch.zeros(stored.shape, dtype=stored.dtype)
    for piece in stored.pieces:
        out[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.sizes))] = index.read_piece(piece, stored.dtype)
    return out


def _write_files(folder: Path, names: list[str], plans: list, items: dict[str, _Item],
                 index: CheckpointIndex) -> None:
    for name, entries in zip(names, plans):
        target = SafetensorsFile(str(folder / name), entries)
        try:
            for entry in entries:
                _copy(index, items[entry.key], entry.dtype, target)
        finally:
            target.close()


def _selected(index: CheckpointIndex, prefix: str) -> list[StoredTensor]:
    """The checkpoint's tensors under ``prefix``, renamed without it."""
    if not prefix:
        return list(index)
    head = prefix.rstrip(".") + "."
    chosen = [dataclasses.replace(t, key=t.key[len(head):]) for t in index if t.key.startswith(head)]
    if not chosen:
        raise ValueError(f"export: no tensor of checkpoint {index.directory} is under prefix {prefix!r} "
                         f"(its keys begin {sorted(index.tensors)[:3]})")
    return chosen


def _copy(index: CheckpointIndex, item: _Item, dtype: torch.dtype, target: SafetensorsFile) -> None:
    """Every piece of ``item``, read, cast and written at its place, one at a time (or its whole
    computed value)."""
    if item.whole is not None:
        target.write(item.key, item.shape, (0,) * len(item.shape), item.whole().to(dtype))
        return
    stored = item.source
    for piece in stored.pieces:
        value = index.read_piece(piece, stored.dtype).to(dtype)
        target.write(item.key, stored.shape, piece.offsets, value)
        del value


def _write_index(out: Path, weight_map: dict[str, str], total: int) -> Path:
    path = out / INDEX
    path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return path


def _copy_configs(folders: list[Path], out: Path) -> list[Path]:
    """The configs found in the first of ``folders`` holding each, copied into ``out``."""
    copied = []
    for name in CONFIG_FILES:
        for folder in folders:
            if (folder / name).is_file():
                copied.append(Path(shutil.copyfile(folder / name, out / name)))
                break
    return copied
