"""The sharded checkpoint folders of the Lightning strategies: one DCP checkpoint, every rank its own shards.

The path Lightning names (``epoch=0-step=20.ckpt``, ``last.ckpt``, ``fabric.save(path, ...)``) is
a folder holding one DCP checkpoint (``parts.comm.dcp``: written as a transaction, so the
previous checkpoint at that path is replaced only once the new one is complete). Its entries:

- the model's ``state_dict()`` keys (the Trainer's LightningModule at the top level; under
  Fabric each module under its name in the saved dict), as ``sharded_state_dict`` views: every
  rank writes its own shards, and the folder loads at any world size;
- each optimizer's state, as ``sharded_optimizer_state_dict`` gives it (FQN keys);
- the rest of the checkpoint (Lightning's loops, callbacks, schedulers and hyperparameters;
  Fabric's other values) as rank 0 holds it, serialized by ``torch.save`` into the one entry
  ``parts_lightning`` and read back with ``torch.load`` (``weights_only`` as Lightning passes it).

``python -m parts.export FOLDER OUT`` writes the model inside as Hugging Face safetensors
(optimizer and non-tensor entries are left out; a model under one top-level name, a
LightningModule's ``self.model`` say, is written without it).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

REST = "parts_lightning"  # the entry holding the rest of the checkpoint
_METADATA = ".metadata"


def _dcp() -> Any:
    """``parts.comm.dcp``, imported on first use (torch.distributed.checkpoint takes seconds)."""
    from parts.comm import dcp
    return dcp


def is_folder(path: Path) -> bool:
    """True if ``path`` is a complete DCP checkpoint folder."""
    return (Path(path) / _METADATA).is_file()


def _serialized(rest: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(rest, buffer)
    return buffer.getvalue()


def save_folder(path: Path, state: dict[str, Any], rest: Any, *, is_global_zero: bool) -> None:
    """Write ``state`` (views of this rank's shards, optimizer states) and rank 0's ``rest`` into the
    DCP folder ``path`` (a collective: every rank calls it)."""
    if REST in state:
        raise ValueError(f"parts strategy: {REST!r} names the entry that holds the rest of a checkpoint; "
                         f"rename the state entry {REST!r}")
    entries = dict(state)
    if is_global_zero:
        entries[REST] = _serialized(rest)
    _dcp().save(entries, checkpoint_id=Path(path))


def load_folder(path: Path, state: dict[str, Any], *, strict: bool = True,
                weights_only: Optional[bool] = None) -> Any:
    """Load the DCP folder ``path`` (written at any world size) into ``state`` in place; return the
    rest of the checkpoint (a collective: every rank calls it)."""
    path = Path(path)
    if not is_folder(path):
        what = "a single file, not a parts checkpoint folder" if path.is_file() else "no DCP checkpoint"
        raise FileNotFoundError(f"parts strategy: {path} is {what}; the parts strategies read the sharded "
                                f"folders they write (the model of another checkpoint loads with "
                                f"parts.partition.load_full_state_dict)")
    entries = {**state, REST: b""}
    _dcp().load(entries, checkpoint_id=path, strict=strict)
    state.update((key, entries[key]) for key in state)
    return torch.load(io.BytesIO(entries[REST]), weights_only=weights_only)


def missing_keys(path: Path, keys: Iterable[str]) -> list[str]:
    """Those of the (flattened) ``keys`` that the DCP folder ``path`` does not hold."""
    from parts.comm.dcp_files import read_metadata
    saved = set(read_metadata(Path(path)).state_dict_metadata)
    return sorted(k for k in keys if k not in saved)
