"""Where a group's collectives take their tensors, and which algorithms carry them.

The communication device of a group (``comm_device``) is the one device every tensor handed
to one of its collectives lives on: the current accelerator for NCCL and every other
accelerator backend, the CPU for gloo and without a process group. Tensors ``parts`` makes
for a collective (norms, flags, headers, pickled objects) are made there (``comm_tensor``,
``to_comm``) and
read back with one host copy (``to_host``); host buffers (IO blocks, store memory) name the
CPU themselves. Nothing here follows ``torch.set_default_device``.

Two process-wide switches, off unless a ``with`` block turns them on, serve tests and checks:

- ``declared_comm_device(device)``: every group's communication device is ``device`` inside
  (an audit declares one that differs from the parameters' device, so a tensor made on the
  CPU by mistake shows on a machine without an accelerator);
- ``torch_algorithms()``: inside, flat all-gathers and reduce-scatters use torch's
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` on every backend, the path NCCL
  takes, in place of the gloo algorithms of ``parts.comm.gloo`` (whose reduce-scatter uses
  send/recv, which gloo lacks for CUDA tensors).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from parts.base.device import accelerator_device
from parts.comm.group import GroupInfo

_CPU = torch.device("cpu")
_declared: list[torch.device] = []
_torch_algorithms: list[bool] = []


def comm_device(info: GroupInfo) -> torch.device:
    """The device every tensor of ``info``'s collectives lives on: the declared one inside
    ``declared_comm_device``, else the CPU for gloo (and for no group), else the current
    accelerator (the CPU on a machine without one)."""
    if _declared:
        return _declared[-1]
    if info.group is None or info.backend == "gloo":
        return _CPU
    return accelerator_device() or _CPU


@contextlib.contextmanager
def declared_comm_device(device: torch.device | str) -> Iterator[torch.device]:
    """Inside the block, ``comm_device`` answers ``device`` for every group (tests, audits)."""
    _declared.append(torch.device(device))
    try:
        yield _declared[-1]
    finally:
        _declared.pop()


def to_comm(t: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """``t`` on ``info``'s communication device (``t`` itself where it is there already)."""
    return t.to(comm_device(info))


def comm_tensor(values: object, dtype: torch.dtype, info: GroupInfo) -> torch.Tensor:
    """A tensor of host ``values`` on ``info``'s communication device: made on the CPU, then one
    copy there (what ``torch.tensor(..., device=...)`` does too, but through ``to_comm``)."""
    return to_comm(torch.tensor(values, dtype=dtype, device=_CPU), info)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU: one device-to-host copy (none for a CPU tensor)."""
    return t.to(_CPU)


@contextlib.contextmanager
def torch_algorithms() -> Iterator[None]:
    """Inside the block, flat all-gathers and reduce-scatters use torch's collectives on every
    backend (the NCCL code path), never the gloo algorithms of ``parts.comm.gloo``."""
    _torch_algorithms.append(True)
    try:
        yield
    finally:
        _torch_algorithms.pop()


def gloo_algorithms(group: Optional[dist.ProcessGroup] = None) -> bool:
    """True when ``group``'s flat collectives run parts' gloo algorithms: a gloo group, outside
    ``torch_algorithms``."""
    return not _torch_algorithms and dist.get_backend(group) == "gloo"
