"""Run by test_reliability_io.py in a fresh process (peak RSS is a process high-water mark):
peak RSS growth of parts.io.save, torch.load and parts.io.load of a checkpoint of MIB MiB.
Prints one line: ``save torch_load parts_load`` growths in bytes."""

import functools
import gc
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore", "Failed to initialize NumPy")

import torch  # noqa: E402

import parts.io as pio  # noqa: E402
from parts.observe import reset_peak_memory, snapshot  # noqa: E402


def growth(fn) -> int:
    """Peak RSS above the RSS before ``fn()`` (its result dropped after)."""
    reset_peak_memory()
    base = snapshot().rss_bytes
    result = fn()
    peak = snapshot().peak_rss_bytes
    del result
    gc.collect()
    return peak - base


def main(mib: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        obj = {f"t{i}": torch.randn(mib * 2**20 // 4 // 8) for i in range(8)}
        torch.save(obj, f"{tmp}/plain.pt")
        save = growth(functools.partial(pio.save, obj, f"{tmp}/ck.pt"))
        del obj
        gc.collect()
        plain = growth(lambda: torch.load(f"{tmp}/plain.pt", weights_only=True))
        ours = growth(lambda: pio.load(f"{tmp}/ck.pt"))
    print(save, plain, ours)


if __name__ == "__main__":
    main(int(sys.argv[1]))
