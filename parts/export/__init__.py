"""parts.export: a sharded DCP checkpoint to Hugging Face safetensors files, streamed, all or nothing.

    python -m parts.export CHECKPOINT_DIR OUT_DIR [--max-shard-size 5GB] [--dtype bfloat16] [--merge]
                                                  [--prefix KEY] [--config CONFIG_JSON]

``export(checkpoint_dir, out_dir)`` reads a checkpoint written by ``parts.comm.dcp.save`` of
``sharded_state_dict(model)``, by ``torch.distributed.checkpoint.save`` or by FSDP2, at any world
size and however its tensors were split (or the one model checkpoint inside a parts Trainer's
``checkpoint-N/`` or an accelerate ``save_state`` folder), and writes ``model.safetensors`` (or
``model-0000i-of-0000n.safetensors`` files of at most ``max_shard_size`` bytes each and
``model.safetensors.index.json``), keyed by the model's keys, which ``from_pretrained``
and ``parts.partition.load_pretrained`` read. The checkpoint may hold more than the model: an
optimizer's state and non-tensor entries are left out, and a model saved under one top-level key
(``dcp.save({"model": ..., "optimizer": ...})``) is written without it (``parts.export.select``).
Where a ``config.json`` is found (or given), the keys are checked against its architecture's
before anything is written, and a mismatch is refused, naming ``prefix``
(``parts.export.architecture``). One process, no process group: each stored piece
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
from parts.export import peft, select
from parts.export.architecture import Architecture, load
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
    (``model``, a peft ``adapter``, a ``merged`` model), the DCP checkpoint it read, the
    earlier export's weight files it removed from the output folder, the prefix removed from the
    keys, the checkpoint's top-level entries left out, and what the keys were checked against."""

    files: list[Path]
    index: Optional[Path]
    configs: list[Path]
    tensors: int
    total_bytes: int
    skipped: list[str]
    kind: str = "model"
    checkpoint: Optional[Path] = None
    removed: list[Path] = dataclasses.field(default_factory=list)
    prefix: str = ""
    left_out: list[str] = dataclasses.field(default_factory=list)
    checked: str = ""


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
           prefix: Optional[str] = None, merge: bool = False,
           config: Union[str, os.PathLike, None] = None) -> ExportResult:
    """Stream the DCP checkpoint at ``checkpoint_dir`` into safetensors files in ``out_dir``, all or nothing.

    ``checkpoint_dir`` may be a Trainer or accelerate checkpoint folder holding the model's DCP
    checkpoint. ``prefix``: export only the keys under it, without it (``"model"`` for a
    checkpoint saved as ``dcp.save({"model": state_dict})``; ``""``: the keys as they are; None: the
    one top-level key holding the model's tensors, where there is one, else the keys as they are).
    ``config``: a ``config.json`` (or a folder holding one) to check the keys against and copy,
    in place of the one beside the checkpoint. A peft LoRA model is exported as its
    adapter (``adapter_model.safetensors``, ``adapter_config.json``), or with ``merge`` as the
    plain model with the adapter merged."""
    given = Path(checkpoint_dir)
    checkpoint = locate(given)
    refuse_into_checkpoint(Path(out_dir), given, checkpoint)
    index = CheckpointIndex(checkpoint)
    folders = [checkpoint, given, checkpoint.parent]
    config_file = _config_file(config, folders)
    architecture = load(config_file) if config_file else f"no config.json in {checkpoint} or beside it (--config)"
    chosen, items, kind, extra = _choose(index, prefix, architecture,
                                         functools.partial(_items, index, dtype=dtype, merge=merge, folders=folders))
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
            else _copy_configs(config_file, folders, staging.dir)
        removed = staging.commit()
    except BaseException:
        staging.abandon()
        raise
    out = staging.out
    return ExportResult([out / n for n in names], out / INDEX if len(plans) > 1 else None,
                        [out / Path(c).name for c in configs], len(items), total, list(index.skipped),
                        kind, checkpoint, removed, chosen.prefix, chosen.left_out,
                        _checked(architecture, kind))


def _config_file(config: Union[str, os.PathLike, None], folders: list[Path]) -> Optional[Path]:
    """The ``config.json`` given (a file, or a folder holding one), else the first beside the checkpoint."""
    if config is not None:
        path = Path(config) / "config.json" if Path(config).is_dir() else Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"export: config {config} is not a config.json nor a folder holding one")
        return path
    return next((f / "config.json" for f in folders if (f / "config.json").is_file()), None)


def _checked(architecture: Union[Architecture, str], kind: str) -> str:
    if kind == "adapter":
        return "keys not checked: a peft adapter, in peft's layout"
    if isinstance(architecture, str):
        return f"keys not checked: {architecture}"
    return f"keys checked against {architecture.name} of {architecture.config}"


def _attempt(option: select.Selection, architecture: Union[Architecture, str], items_of: Callable,
             first: bool) -> Optional[tuple[list, str, list[Path], Optional[tuple]]]:
    """``option``'s items, kind, extra files and mismatch (None: loads, or not checked); None where
    an option other than the ``first`` cannot be exported."""
    try:
        items, kind, extra = items_of(option.tensors)
    except (ValueError, FileNotFoundError):
        if first:
            raise
        return None
    checked = kind != "adapter" and isinstance(architecture, Architecture)
    return items, kind, extra, architecture.mismatch(i.key for i in items) if checked else None


def _choose(index: CheckpointIndex, prefix: Optional[str], architecture: Union[Architecture, str],
            items_of: Callable) -> tuple[select.Selection, list, str, list[Path]]:
    """The first way to read the checkpoint whose keys ``architecture`` loads (the first where not
    checked): its selection, items, kind and extra files; else a refusal naming ``--prefix``."""
    options = select.candidates(index, prefix)
    tried = _attempt(options[0], architecture, items_of, True)
    for n, option in enumerate(options):
        found = tried if n == 0 else _attempt(option, architecture, items_of, False)
        if found is not None and found[3] is None:
            return option, *found[:3]
    defaults = select.candidates(index, None) if prefix is not None else []
    fitting = [o.prefix for o in defaults if (f := _attempt(o, architecture, items_of, False)) and f[3] is None]
    raise _refusal(index, architecture, options[0], tried[3], fitting)


def _refusal(index: CheckpointIndex, architecture: Architecture, option: select.Selection,
             found: tuple[list[str], list[str]], fitting: list[str]) -> ValueError:
    """The error naming ``--prefix`` for keys that ``architecture`` does not load."""
    missing, foreign = found
    entries = sorted({k.split(".", 1)[0] for k in [*index.tensors, *index.skipped]})
    without = f" (without the prefix {option.prefix!r})" if option.prefix else ""
    return ValueError(
        f"export: the keys of checkpoint {index.directory}{without} are not those of {architecture.name} "
        f"({architecture.config}): {len(missing)} of its weights are missing (e.g. {missing[:3]}) and "
        f"{len(foreign)} keys are not its own (e.g. {foreign[:3]}); from_pretrained would initialise the "
        f"missing weights afresh. " + (f"--prefix {fitting[0]!r} (prefix=) exports keys it loads" if fitting else
        f"Name the top-level key that holds the model with --prefix (prefix=): the checkpoint's are "
        f"{entries[:8]}; --prefix '' keeps the keys as they are; or pass the model's own config.json "
        f"with --config"))


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


def _items(index: CheckpointIndex, tensors: list[StoredTensor], *, dtype: Optional[torch.dtype], merge: bool,
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


def _copy_configs(config: Optional[Path], folders: list[Path], out: Path) -> list[Path]:
    """``config`` as ``config.json``, then each config not yet copied from the first of ``folders`` holding it."""
    copied = [Path(shutil.copyfile(config, out / CONFIG_FILES[0]))] if config else []
    for name in CONFIG_FILES[len(copied):]:
        for folder in folders:
            if (folder / name).is_file():
                copied.append(Path(shutil.copyfile(folder / name, out / name)))
                break
    return copied
