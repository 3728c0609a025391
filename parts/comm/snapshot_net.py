"""Snapshot files between hosts that do not share memory (``parts.comm.Snapshots`` on nodes
with a ``/dev/shm`` of their own): point-to-point sends over a gloo group of their own.

The background thread of a snapshot sends this rank's files to its buddy rank (the rank of the
same local index on the next node) while it receives its predecessor's; a restore moves the
files a node lacks from a rank that holds them. Both run on ``copy_group``, a process group made
for the copies alone: gloo pairs the messages of one group in the order each rank issues them,
so sends from a background thread on the default group would pair with the training loop's
collectives.

Each file travels as one uint8 tensor mapped onto the file itself (``torch.from_file``): the
sender reads from its ``/dev/shm`` file and the receiver writes into a file of the announced
size, renamed into place once whole, so no second copy of the state is held in memory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from parts.comm.group import GroupInfo


def copy_group(info: GroupInfo) -> Any:
    """A gloo process group over ``info``'s ranks for snapshot copies (collective over them)."""
    return dist.new_group(info.global_ranks(), backend="gloo", use_local_synchronization=True)


def _mapped(path: Path, size: int) -> torch.Tensor:
    """``size`` bytes of the file at ``path`` as a uint8 tensor that shares the file's memory."""
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def _wait(works: Iterable[Any]) -> None:
    for work in works:
        work.wait()


def _header(names: list[str], folder: Path) -> torch.Tensor:
    """The names and sizes of the files to send, as JSON bytes in a uint8 tensor."""
    listing = [[name, os.stat(folder / name).st_size] for name in names]
    return torch.frombuffer(bytearray(json.dumps(listing).encode()), dtype=torch.uint8)


def _listing(data: torch.Tensor, src: int) -> list[tuple[str, int]]:
    """The (name, size) pairs a header from global rank ``src`` announced (plain file names only)."""
    listing = json.loads(bytes(data.tolist()).decode())
    for name, size in listing:
        if not isinstance(name, str) or "/" in name or name in ("", ".", "..") or not isinstance(size, int):
            raise ValueError(f"parts.comm.Snapshots: global rank {src} announced a file {name!r} of size "
                             f"{size!r}: not a plain file name and size")
    return [(name, size) for name, size in listing]


def exchange(group: Any, dst: int, src: int, names: list[str], source: Path, destination: Path) -> int:
    """Send the files ``names`` of ``source`` to global rank ``dst`` while receiving the files
    global rank ``src`` sends into ``destination``; the bytes sent."""
    header, length = _header(names, source), torch.empty(1, dtype=torch.int64)
    _wait([dist.isend(torch.tensor([header.numel()]), dst, group=group), dist.irecv(length, src, group=group)])
    theirs = torch.empty(int(length.item()), dtype=torch.uint8)
    _wait([dist.isend(header, dst, group=group), dist.irecv(theirs, src, group=group)])
    incoming, sent = _listing(theirs, src), 0
    for k in range(max(len(names), len(incoming))):
        works, tensors, received = [], [], None
        if k < len(names) and os.stat(source / names[k]).st_size:
            tensors.append(_mapped(source / names[k], os.stat(source / names[k]).st_size))
            works.append(dist.isend(tensors[-1], dst, group=group))
            sent += tensors[-1].numel()
        if k < len(incoming):
            received = _receiving(destination, *incoming[k])
            works += [dist.irecv(received[1], src, group=group)] if incoming[k][1] else []
        _wait(works)
        if received is not None:
            os.replace(received[0], destination / incoming[k][0])
    return sent


def _receiving(folder: Path, name: str, size: int) -> tuple[Path, torch.Tensor]:
    """A temporary file of ``size`` bytes for ``name`` in ``folder``, and the tensor mapped onto it."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{name}.part"
    with open(tmp, "wb") as f:
        f.truncate(size)
    return tmp, _mapped(tmp, size) if size else torch.empty(0, dtype=torch.uint8)


def send_file(group: Any, dst: int, path: Path, size: int) -> None:
    """Send the ``size`` bytes of ``path`` to global rank ``dst``."""
    if size:
        dist.isend(_mapped(path, size), dst, group=group).wait()


def recv_file(group: Any, src: int, path: Path, size: int) -> None:
    """Receive ``size`` bytes from global rank ``src`` into the file ``path`` (whole, or not there)."""
    tmp, tensor = _receiving(path.parent, path.name, size)
    if size:
        dist.irecv(tensor, src, group=group).wait()
    del tensor
    os.replace(tmp, path)
