"""The current accelerator, if any: the one place parts asks torch which device computes."""

from __future__ import annotations

from typing import Optional

import torch


def accelerator_device() -> Optional[torch.device]:
    """The current accelerator device (with its index), or ``None`` on a CPU-only machine."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        if not acc.is_available():
            return None
        return torch.device(acc.current_accelerator().type, acc.current_device_index())
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def synchronize_accelerator() -> None:
    """Wait for the current accelerator's queued work; a no-op on CPU."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        acc.synchronize()
    elif acc is None and torch.cuda.is_available():
        torch.cuda.synchronize()


def host_memory_available() -> Optional[int]:
    """Bytes the OS can give without swapping (``MemAvailable`` of /proc/meminfo), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for row in f:
                if row.startswith("MemAvailable:"):
                    return int(row.split()[1]) * 1024
    except OSError:
        pass
    return None
