"""Memory reports: process RSS and peak RSS, system memory, accelerator allocator counters.

``memory_usage`` is meant to be sprinkled through hot code: unless ``force=True`` or the
environment variable ``PARTS_MEMORY_LOG`` is ``1`` it returns ``None`` after one dict
lookup. When it runs, every rank builds and returns its own ``MemoryReport`` and rank 0
(of the default group, or the only process) prints it as one line. Non-zero ranks return
the report without printing, so a caller can compare ranks or gather the reports itself.
Nothing here needs psutil: CPU numbers come from ``/proc`` (Linux) with a ``getrusage``
fallback for the peak elsewhere.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from parts.observe._collectives import rank as _rank
from parts.base.device import accelerator_device

ENV_VAR = "PARTS_MEMORY_LOG"
_KIB = 1024


@dataclass(frozen=True)
class MemoryReport:
    """One snapshot of this process's memory, in bytes (``None`` where not measurable)."""

    message: str
    rank: int
    rss_bytes: Optional[int]
    peak_rss_bytes: Optional[int]
    system_used_bytes: Optional[int]
    system_total_bytes: Optional[int]
    device: Optional[str] = None
    allocated_bytes: Optional[int] = None
    peak_allocated_bytes: Optional[int] = None
    reserved_bytes: Optional[int] = None

    def __str__(self) -> str:
        parts = [f"[rank {self.rank}] {self.message}",
                 f"RSS {_fmt(self.rss_bytes)} (peak {_fmt(self.peak_rss_bytes)})",
                 f"system {_fmt(self.system_used_bytes)} / {_fmt(self.system_total_bytes)}"]
        if self.device is not None:
            parts.append(f"{self.device} allocated {_fmt(self.allocated_bytes)} "
                         f"(peak {_fmt(self.peak_allocated_bytes)}) "
                         f"reserved {_fmt(self.reserved_bytes)}")
        return " | ".join(parts)


def _fmt(nbytes: Optional[int]) -> str:
    """Bytes as GiB when at least 1 GiB, else MiB; ``n/a`` for ``None``."""
    if nbytes is None:
        return "n/a"
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.2f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"


def memory_usage(message: str, force: bool = False,
                 reset_peak: bool = False) -> Optional[MemoryReport]:
    """Report this process's memory (printed on rank 0); ``None`` unless forced or enabled."""
    if not force and os.environ.get(ENV_VAR) != "1":
        return None
    report = snapshot(message)
    if report.rank == 0:
        print(str(report), flush=True)
    if reset_peak:
        reset_peak_memory()
    return report


def snapshot(message: str = "") -> MemoryReport:
    """Build a ``MemoryReport`` now, on any rank, without printing."""
    status = _read_kib_fields("/proc/self/status", ("VmRSS", "VmHWM"))
    meminfo = _read_kib_fields("/proc/meminfo", ("MemTotal", "MemAvailable"))
    total, available = meminfo.get("MemTotal"), meminfo.get("MemAvailable")
    used = total - available if total is not None and available is not None else None
    return MemoryReport(
        message=message, rank=_rank(), rss_bytes=status.get("VmRSS"),
        peak_rss_bytes=status.get("VmHWM") or _rusage_peak_bytes(),
        system_used_bytes=used, system_total_bytes=total, **_accelerator_fields())


def reset_peak_memory() -> bool:
    """Reset the peak RSS (Linux ``clear_refs``) and accelerator peak; True if RSS peak was reset."""
    device = accelerator_device()
    if device is not None:
        _memory_api("reset_peak_memory_stats")()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _read_kib_fields(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    """Read ``Key: N kB`` lines of a /proc file as bytes; empty where the file is missing."""
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in keys:
                    out[key] = int(rest.split()[0]) * _KIB
    except OSError:
        pass
    return out


def _rusage_peak_bytes() -> int:
    """Peak RSS from getrusage (KiB on Linux, bytes on macOS); never reset."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * _KIB


def _memory_api(name: str):
    """``torch.accelerator.<name>`` where it exists, else ``torch.cuda.<name>``."""
    acc = getattr(torch, "accelerator", None)
    fn = getattr(acc, name, None) if acc is not None else None
    return fn if fn is not None else getattr(torch.cuda, name)


def _accelerator_fields() -> dict:
    """Allocator counters of the current accelerator, or no fields on CPU."""
    device = accelerator_device()
    if device is None:
        return {}
    return {"device": str(device),
            "allocated_bytes": int(_memory_api("memory_allocated")()),
            "peak_allocated_bytes": int(_memory_api("max_memory_allocated")()),
            "reserved_bytes": int(_memory_api("memory_reserved")())}
