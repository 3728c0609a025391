"""The safetensors format, written directly: an 8-byte little-endian header length, a JSON header
(each tensor's dtype, shape and byte range in the data that follows), then the raw bytes.

A file's header is known before any tensor is read (shapes and dtypes come from the checkpoint's
metadata), so the file is laid out first and each stored piece of a tensor is written at its
place (``os.pwrite``) as it is read: nothing is assembled in memory.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


@dataclass(frozen=True)
class Entry:
    """One tensor of an output file: key, shape, dtype and byte range in the file's data."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    begin: int

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor in the file."""
        return math.prod(self.shape) * self.dtype.itemsize


def plan_files(tensors: Iterable[tuple[str, tuple[int, ...], torch.dtype]], max_bytes: int) -> list[list[Entry]]:
    """Tensors in order, split into files of at most ``max_bytes`` of data (a larger tensor alone)."""
    files: list[list[Entry]] = [[]]
    used = 0
    for key, shape, dtype in tensors:
        size = math.prod(shape) * dtype.itemsize
        if files[-1] and used + size > max_bytes:
            files.append([])
            used = 0
        files[-1].append(Entry(key, tuple(shape), dtype, used))
        used += size
    return files if files[0] else []


def header(entries: Sequence[Entry]) -> bytes:
    """The JSON header of a file holding ``entries``, padded with spaces to a multiple of 8 bytes."""
    body = {"__metadata__": {"format": "pt"}}
    for e in entries:
        if e.dtype not in DTYPE_NAMES:
            raise ValueError(f"safetensors has no dtype for {e.key} ({e.dtype})")
        body[e.key] = {"dtype": DTYPE_NAMES[e.dtype], "shape": list(e.shape),
                       "data_offsets": [e.begin, e.begin + e.nbytes]}
    text = json.dumps(body, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def runs(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """The contiguous runs of a box (``offsets``, ``sizes``) of a row-major tensor of ``shape``:
    (element index in the box, element index in the tensor, elements), box in row-major order."""
    dims = len(shape)
    cut = max((k for k in range(dims) if sizes[k] != shape[k]), default=-1)
    if cut < 0:
        yield 0, 0, math.prod(shape)
        return
    strides = [math.prod(shape[k + 1:]) for k in range(dims)]
    length = sizes[cut] * strides[cut]
    outer = sizes[:cut]
    for n in range(math.prod(outer)):
        index, rest = [], n
        for size in reversed(outer):
            index.append(rest % size)
            rest //= size
        index.reverse()
        start = sum((offsets[k] + index[k]) * strides[k] for k in range(cut)) + offsets[cut] * strides[cut]
        yield n * length, start, length


def _view_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor ``t``, without a copy (``t`` must outlive the view)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``os.pwrite`` until every byte is written (one call may write less)."""
    while data:
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


class SafetensorsFile:
    """An output file laid out for ``entries``: header written, data filled by ``write``."""

    def __init__(self, path: str, entries: Sequence[Entry]) -> None:
        self.path, self.entries = path, {e.key: e for e in entries}
        head = header(entries)
        self.data_start = 8 + len(head)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, self.data_start + sum(e.nbytes for e in entries))
        os.pwrite(self.fd, struct.pack("<Q", len(head)) + head, 0)

    def write(self, key: str, shape: Sequence[int], offsets: Sequence[int], piece: torch.Tensor) -> None:
        """Write ``piece`` (a box at ``offsets`` of tensor ``key``, already in the file's dtype)."""
        entry = self.entries[key]
        piece = piece.contiguous()
        if piece.numel() == 0:
            return
        data, size = _view_bytes(piece), piece.element_size()
        base = self.data_start + entry.begin
        for at, start, count in runs(shape, offsets, piece.shape):
            _pwrite_all(self.fd, data[at * size:(at + count) * size], base + start * size)
        del data

    def close(self) -> None:
        """Flush the file to disk and close it."""
        os.fsync(self.fd)
        os.close(self.fd)
