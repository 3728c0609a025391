"""Reading a DCP checkpoint directory one stored piece at a time, in one process, without a group.

A checkpoint written by ``parts.comm.dcp.save``, ``torch.distributed.checkpoint.save`` or FSDP2
at any world size stores each tensor as pieces (one box of the global tensor per rank, or
several where a rank's shard is a flat range), each a ``torch.save`` blob at an offset of a
rank's file. ``CheckpointIndex`` lists every tensor with its global shape, dtype and pieces
from ``.metadata`` (read with ``dcp_files``' allow-list unpickler: no code runs); ``read_piece``
loads one piece, so a reader holds one piece at a time. A checkpoint with a manifest
(``parts``) has each data file checked against it (size, SHA-256) before its first read.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from parts.base.files import CheckpointError
from parts.comm import dcp_files as files

_ZIP = b"PK\x03\x04"


@dataclass(frozen=True)
class Piece:
    """One stored box of a tensor: where it sits in the global tensor and in which file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    relative_path: str
    offset: int
    length: int


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of the checkpoint: its key, global shape, dtype and stored pieces."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        """Elements of the global tensor."""
        n = 1
        for size in self.shape:
            n *= size
        return n


class CheckpointIndex:
    """The tensors of a DCP checkpoint directory (``tensors``, by key) and a reader of their pieces."""

    def __init__(self, directory: Union[str, os.PathLike]) -> None:
        self.directory = Path(directory)
        self.manifest: Optional[dict] = files.open_checkpoint(self.directory)
        metadata = files.read_metadata(self.directory)
        self.tensors: dict[str, StoredTensor] = {}
        self.skipped: list[str] = []  # non-tensor entries (bytes, objects): no place in safetensors
        where = _tensor_storage(metadata.storage_data)
        for key, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                self.tensors[key] = _stored(self.directory, key, entry, where)
            else:
                self.skipped.append(key)
        self._verified: set[str] = set()

    def __iter__(self) -> Iterator[StoredTensor]:
        return iter(self.tensors.values())

    def read_piece(self, piece: Piece, dtype: torch.dtype) -> torch.Tensor:
        """The stored piece as a ``dtype`` tensor of shape ``piece.sizes`` (its file checked first, once)."""
        if piece.relative_path not in self._verified:
            files.verify_reads(self.directory, self.manifest, [piece.relative_path])
            self._verified.add(piece.relative_path)
        path = self.directory / piece.relative_path
        with open(path, "rb") as handle:
            handle.seek(piece.offset)
            blob = handle.read(piece.length)
        if len(blob) != piece.length:
            raise CheckpointError(f"checkpoint file {path} ends before the piece at {piece.offset} "
                                  f"(+{piece.length} bytes): truncated", path=path)
        if blob[:4] == _ZIP:  # torch.save's format (DCP's default)
            tensor = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        else:  # raw bytes
            tensor = torch.frombuffer(bytearray(blob), dtype=dtype).reshape(piece.sizes)
        del blob
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != piece.sizes:
            raise CheckpointError(f"checkpoint file {path}: the piece at {piece.offset} is not a tensor "
                                  f"of shape {list(piece.sizes)}", path=path)
        return tensor


def _tensor_storage(storage: dict) -> dict:
    """The storage data of the tensor pieces, by (key, offsets): DCP indexes a piece so, and a
    bytes or object entry (an optimizer's hyperparameters, an extra state) with no offsets."""
    return {(index.fqn, tuple(index.offset)): info for index, info in storage.items() if index.offset is not None}


def _stored(directory: Path, key: str, entry: TensorStorageMetadata, where: dict) -> StoredTensor:
    """``key``'s pieces, each located in the tensor storage data ``where`` (by key and offsets)."""
    pieces = []
    for chunk in entry.chunks:
        info = where.get((key, tuple(chunk.offsets)))
        if info is None:
            raise CheckpointError(f"checkpoint {directory}: .metadata lists a piece of {key} at "
                                  f"{list(chunk.offsets)} but no file holds it", path=directory)
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"checkpoint {directory}: {key} is stored with transforms "
                                  f"{list(info.transform_descriptors)}; read it with dcp.load", path=directory)
        pieces.append(Piece(tuple(chunk.offsets), tuple(chunk.sizes), info.relative_path,
                            info.offset, info.length))
    stored = StoredTensor(key, tuple(entry.size), entry.properties.dtype, tuple(pieces))
    _check_cover(directory, stored)
    return stored


def _check_cover(directory: Path, stored: StoredTensor) -> None:
    """``CheckpointError`` unless the pieces lie inside the tensor and hold as many elements as it."""
    held = 0
    for piece in stored.pieces:
        if len(piece.offsets) != len(stored.shape) or any(
                o < 0 or n < 0 or o + n > size for o, n, size in zip(piece.offsets, piece.sizes, stored.shape)):
            raise CheckpointError(f"checkpoint {directory}: .metadata puts a piece of {stored.key} at "
                                  f"{list(piece.offsets)} (+{list(piece.sizes)}), outside its shape "
                                  f"{list(stored.shape)}", path=directory)
        held += math.prod(piece.sizes)
    if held != stored.numel:
        raise CheckpointError(f"checkpoint {directory}: the pieces of {stored.key} cover {held} of the "
                              f"{stored.numel} elements its .metadata declares (shape {list(stored.shape)})",
                              path=directory)
