"""Terminal output for the recipes: a one-line progress bar, a summary table, a loss curve PNG."""

from __future__ import annotations

import sys
import time
from typing import Optional, Sequence


class Progress:
    """A single-line progress bar that rewrites itself (rank 0 only), with free-form fields."""

    def __init__(self, total: int, enabled: bool, width: int = 24) -> None:
        self.total, self.enabled, self.width = total, enabled, width
        self.started = time.perf_counter()

    def update(self, step: int, **fields: str) -> None:
        tty = sys.stdout.isatty()
        if not self.enabled or (not tty and step % 10 and step != self.total):
            return  # in a log file, one line every 10 steps
        done = int(self.width * step / max(self.total, 1))
        bar = "#" * done + "." * (self.width - done)
        text = "  ".join(f"{key} {value}" for key, value in fields.items())
        if 0 < step < self.total:
            text += f"  ETA {clock(self.elapsed() * (self.total - step) / step)}"
        end = "\n" if step == self.total or not tty else ""
        print(f"\r[{bar}] {step}/{self.total}  {text}", end=end, flush=True)

    def note(self, message: str) -> None:
        """A line that stays (validation loss, checkpoint saved, ...)."""
        if self.enabled:
            print(("\n" if sys.stdout.isatty() else "") + message, flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def clock(seconds: float) -> str:
    """``seconds`` as m:ss."""
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}:{secs:02d}"


def table(rows: Sequence[tuple[str, str]]) -> str:
    """Two aligned columns with a rule above and below."""
    width = max(len(key) for key, _ in rows)
    rule = "-" * (width + 3 + max(len(value) for _, value in rows))
    return "\n".join([rule, *(f"{key:<{width}}   {value}" for key, value in rows), rule])


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"


def plot_losses(path: str, train: Sequence[tuple[int, float]],
                val: Sequence[tuple[int, float]]) -> Optional[str]:
    """Write the loss curves to ``path`` if matplotlib is installed; return the path or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot(*zip(*train), label="train")
    if val:
        axes.plot(*zip(*val), "o-", label="validation")
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats/char)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _matmul_seconds(dtype, size: int = 256, repeats: int = 20) -> float:
    """Median time of one ``size`` x ``size`` matmul in ``dtype`` on the CPU."""
    import torch
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def fastest_dtype(device=None) -> tuple[str, str]:
    """``("bf16" | "fp32", why)``: bf16 where ``device`` (default: the accelerator if any, else the
    CPU) computes it faster than fp32.

    On an accelerator: bf16 where it supports it. On a CPU, measured: CPUs with bf16 units
    (AVX-512 BF16, AMX) run bf16 matmuls faster than fp32, CPUs without them many times slower.
    """
    import torch
    if device is not None:
        acc = device if device.type != "cpu" else None
    else:
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is not None:
        supported = acc.type != "cuda" or torch.cuda.is_bf16_supported()
        return ("bf16", f"{acc.type} supports bf16") if supported else ("fp32", f"{acc.type} lacks bf16")
    _matmul_seconds(torch.bfloat16, repeats=3)  # warm up both kernels
    ratio = _matmul_seconds(torch.float32) / _matmul_seconds(torch.bfloat16)
    verdict = "bf16" if ratio > 1.0 else "fp32"
    return verdict, f"a bf16 matmul runs {ratio:.2f}x the speed of fp32 on this CPU"
