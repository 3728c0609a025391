"""Where an export writes, and what it looks for: all or nothing into the output folder.

The files are written into ``.<out>.exporting`` beside ``out`` (cleared first: what a killed
export left), checked against the free space first, and moved into place only when every file
is complete: a new ``out`` is the staging folder renamed; into an existing one, the weight files
of an earlier export (``model*.safetensors``, their index, ``pytorch_model*.bin``, a peft
adapter) are removed, then the new files moved in, the file that makes the folder loadable
(``model.safetensors``, the index, ``adapter_config.json``) last. Other files of ``out`` stay.
A failed export removes its staging folder: it leaves no weight file anywhere.

``locate`` finds the model's DCP checkpoint in a folder that holds one: a Trainer checkpoint
(``checkpoint-N/parts_model``), an accelerate ``save_state`` folder (``parts_model_<i>``).
"""

from __future__ import annotations

import errno
import fnmatch
import os
import shutil
from pathlib import Path

from parts.base.files import CheckpointError, fsync_directory

STALE = ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin",
         "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin",
         "adapter_config.json")
LAST = ("model.safetensors", "model.safetensors.index.json", "adapter_config.json")
METADATA = ".metadata"


def is_weight_file(name: str) -> bool:
    """Whether ``name`` is a weight file ``from_pretrained`` / ``PeftModel.from_pretrained`` reads."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in STALE)


def _same_or_inside(inner: Path, outer: Path) -> bool:
    inner, outer = Path(os.path.realpath(inner)), Path(os.path.realpath(outer))
    return inner == outer or outer in inner.parents


def refuse_into_checkpoint(out: Path, *checkpoints: Path) -> None:
    """``ValueError`` if ``out`` is a checkpoint folder given, or inside one."""
    for checkpoint in checkpoints:
        if _same_or_inside(out, checkpoint):
            raise ValueError(f"export: the output folder {out} is the checkpoint folder {checkpoint} "
                             f"{'itself' if _same_or_inside(checkpoint, out) else 'or inside it'}; "
                             f"export into another folder (e.g. {Path(checkpoint).name}-hf beside it)")


class Staging:
    """The folder an export writes into before ``commit`` moves its files to ``out``."""

    def __init__(self, out: Path) -> None:
        self.out = Path(os.path.abspath(out))
        self.dir = self.out.with_name(f".{self.out.name}.exporting")
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)

    def check_space(self, nbytes: int) -> None:
        """``OSError(ENOSPC)`` naming the folder if ``nbytes`` do not fit in its file system's free space."""
        free = shutil.disk_usage(self.dir).free
        if nbytes > free:
            raise OSError(errno.ENOSPC, f"export needs {nbytes} bytes of weights but {free} bytes are free "
                          f"on the file system of {self.out}: nothing written", str(self.out))

    def commit(self) -> list[Path]:
        """Move the finished export into ``out``; returns the earlier export's weight files it removed."""
        if not self.out.exists():
            os.rename(self.dir, self.out)
            fsync_directory(self.out.parent)
            return []
        if not self.out.is_dir():
            raise FileExistsError(f"export: {self.out} is a file, not a folder")
        stale = sorted(p for p in self.out.iterdir() if is_weight_file(p.name) and p.is_file())
        for path in stale:
            path.unlink()
        names = sorted((p.name for p in self.dir.iterdir()), key=lambda name: (name in LAST, name))
        for name in names:
            os.rename(self.dir / name, self.out / name)
        fsync_directory(self.out)
        self.dir.rmdir()
        return [p for p in stale if p.name not in names]

    def abandon(self) -> None:
        """Remove what a failed export wrote."""
        shutil.rmtree(self.dir, ignore_errors=True)


def locate(path: Path) -> Path:
    """The model's DCP checkpoint: ``path`` itself, or the one model checkpoint a Trainer or
    accelerate checkpoint folder holds; ``CheckpointError`` saying where to point otherwise."""
    if (path / METADATA).is_file() or not path.is_dir():
        return path
    found = [p for p in [path / "parts_model", *sorted(path.glob("parts_model_*"))] if (p / METADATA).is_file()]
    if len(found) == 1:
        return found[0]
    if found:
        raise CheckpointError(f"export: {path} holds {len(found)} model checkpoints "
                              f"({', '.join(p.name for p in found)}): point at the one to export, "
                              f"e.g. {found[0]}", path=path)
    runs = sorted((p for p in path.glob("checkpoint-*") if p.is_dir()), key=_step)
    if runs:
        raise CheckpointError(f"export: {path} is a training output folder, not a checkpoint: point at one "
                              f"of its checkpoints, e.g. the latest, {runs[-1]}", path=path)
    raise CheckpointError(f"checkpoint {path} has no {METADATA}: it is not a complete DCP checkpoint, "
                          f"nor a Trainer checkpoint (parts_model/) or accelerate save_state folder "
                          f"(parts_model_0/)", path=path / METADATA)


def _step(path: Path) -> tuple[int, str]:
    tail = path.name.rpartition("-")[2]
    return (int(tail) if tail.isdigit() else -1, path.name)
