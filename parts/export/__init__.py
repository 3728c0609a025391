"""parts.export: a sharded DCP checkpoint to Hugging Face safetensors files, streamed.

    python -m parts.export CHECKPOINT_DIR OUT_DIR [--max-shard-size 5GB] [--dtype bfloat16]

``export(checkpoint_dir, out_dir)`` reads a checkpoint written by ``parts.comm.dcp.save`` of
``sharded_state_dict(model)``, by ``torch.distributed.checkpoint.save`` or by FSDP2, at any world
size and however its tensors were split, and writes ``model.safetensors`` (or
``model-0000i-of-0000n.safetensors`` files of at most ``max_shard_size`` bytes each and
``model.safetensors.index.json``), keyed by the checkpoint's keys, which ``from_pretrained``
and ``parts.partition.load_pretrained`` read. One process, no process group: each stored piece
(one rank's box of one tensor) is read, cast to ``dtype`` and written at its place in the
output file, then dropped, so the bytes held are those of the largest stored piece (about three
times it: the file's bytes, the loaded piece, its cast), whatever the model's size.
``config.json`` and ``generation_config.json`` are copied from the checkpoint directory (or its
parent, where ``parts.integrations.transformers.Trainer`` saves them beside ``parts_model/``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from parts.comm.dcp_read import CheckpointIndex, StoredTensor
from parts.export.safetensors import SafetensorsFile, plan_files

__all__ = ["export", "ExportResult", "parse_size", "INDEX", "CONFIG_FILES"]

INDEX = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class ExportResult:
    """What ``export`` wrote: the safetensors files, the index (None for one file), copied configs,
    tensors written, their bytes, and the checkpoint's non-tensor keys left out."""

    files: list[Path]
    index: Optional[Path]
    configs: list[Path]
    tensors: int
    total_bytes: int
    skipped: list[str]


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
           prefix: str = "") -> ExportResult:
    """Stream the DCP checkpoint at ``checkpoint_dir`` into safetensors files in ``out_dir``.

    ``prefix``: export only the keys under it, without it (``"model"`` for a checkpoint saved as
    ``dcp.save({"model": state_dict})``, whose keys DCP flattens to ``model.<fqn>``)."""
    index = CheckpointIndex(checkpoint_dir)
    tensors = _selected(index, prefix)
    plans = plan_files(((t.key, t.shape, _out_dtype(t, dtype)) for t in tensors), parse_size(max_shard_size))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = _names(len(plans))
    by_key = {t.key: t for t in tensors}
    for name, entries in zip(names, plans):
        target = SafetensorsFile(str(out / name), entries)
        try:
            for entry in entries:
                _copy(index, by_key[entry.key], entry.dtype, target)
        finally:
            target.close()
    weight_map = {e.key: name for name, entries in zip(names, plans) for e in entries}
    total = sum(e.nbytes for entries in plans for e in entries)
    index_path = _write_index(out, weight_map, total) if len(plans) > 1 else None
    return ExportResult([out / n for n in names], index_path, _copy_configs(Path(checkpoint_dir), out),
                        len(tensors), total, list(index.skipped))


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


def _copy(index: CheckpointIndex, stored: StoredTensor, dtype: torch.dtype, target: SafetensorsFile) -> None:
    """Every piece of ``stored``, read, cast and written at its place, one at a time."""
    for piece in stored.pieces:
        value = index.read_piece(piece, stored.dtype).to(dtype)
        target.write(stored.key, stored.shape, piece.offsets, value)
        del value


def _write_index(out: Path, weight_map: dict[str, str], total: int) -> Path:
    path = out / INDEX
    path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return path


def _copy_configs(checkpoint: Path, out: Path) -> list[Path]:
    """The configs found in the checkpoint directory, else its parent, copied into ``out``."""
    copied = []
    for name in CONFIG_FILES:
        for folder in (checkpoint, checkpoint.parent):
            if (folder / name).is_file():
                copied.append(Path(shutil.copyfile(folder / name, out / name)))
                break
    return copied
