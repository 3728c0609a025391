"""Where a recipe runs: ``--device auto|cpu|cuda``, the process group for it, inputs moved there.

``auto`` is CUDA with NCCL where torch sees a CUDA device, else the CPU with gloo. On CUDA each
rank computes on the GPU of its ``LOCAL_RANK`` (``torch.cuda.set_device``), so
``torchrun --nproc-per-node N`` puts one rank on each of a node's first N GPUs.
"""

from __future__ import annotations

import argparse
import os

import torch

from parts.comm import init_process_group

CHOICES = ("auto", "cpu", "cuda")


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    """Add ``--device auto|cpu|cuda`` to a recipe's flags."""
    parser.add_argument("--device", choices=CHOICES, default="auto",
                        help="auto: cuda (NCCL, one GPU per rank by LOCAL_RANK) where torch sees a GPU, "
                             "else cpu (gloo)")


def parse_with_device(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``parser``'s flags plus ``--device``, parsed, the device resolved to cpu or cuda before any worker starts."""
    add_device_flag(parser)
    args = parser.parse_args(argv)
    args.device = resolve(args.device)
    return args


def pick(choice: str) -> torch.device:
    """The device this rank computes on for ``--device choice`` (a CUDA one is made current)."""
    if resolve(choice) == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    if index >= torch.cuda.device_count():
        raise SystemExit(f"--device cuda: LOCAL_RANK={index} but this node has "
                         f"{torch.cuda.device_count()} CUDA device(s); run at most that many ranks per node")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def resolve(choice: str) -> str:
    """``"cpu"`` or ``"cuda"`` for ``--device choice``, checked before any worker starts (nothing is made current)."""
    if choice not in CHOICES:
        raise SystemExit(f"--device {choice!r}: choose one of {', '.join(CHOICES)}")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch sees no CUDA device (torch.cuda.is_available() is "
                         "False); use --device cpu")
    return choice


def init_spawned(choice: str, rank: int, world: int, port: int) -> torch.device:
    """``init`` for a worker this process spawned on one node: rank ``rank`` of ``world``, local rank = rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    return init(choice)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so a timer reads finished steps."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def init(choice: str) -> torch.device:
    """Start the default process group for ``--device choice`` (NCCL on CUDA, gloo on the CPU)
    and return this rank's device; ``parts.comm.init_process_group``, so that a group torchrun's
    agent restarts (``--max-restarts``) connects."""
    device = pick(choice)
    if device.type == "cuda":
        init_process_group("nccl", device_id=device)
    else:
        init_process_group("gloo")
    return device


def to(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` on ``device`` (the same tensors on the CPU)."""
    return tuple(t.to(device, non_blocking=True) for t in tensors)
