"""Each GPU-capable benchmark's ``--device auto|cpu|cuda`` flag, through its ``parse_args``.

The parser accepts ``--device cpu``, refuses a name that is not a choice, and on a machine
where torch sees no CUDA device stops ``--device cuda`` with a message that says so, before any
worker starts. Nothing here runs a benchmark.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
GPU_BENCHMARKS = ["bench_zero3", "bench_offload_world1", "bench_optim", "bench_optim_whole", "bench_compile",
                  "bench_compression", "bench_generate", "bench_checkpoint", "bench_checkpoint_dcp", "bench_offload",
                  "bench_offload_pipeline", "bench_offload_infinity", "bench_offload_soak", "bench_overlap",
                  "precision_experiments", "recipe_rss"]


def _module(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


@pytest.mark.parametrize("name", GPU_BENCHMARKS)
def test_device_cpu_accepted(name: str) -> None:
    """``--device cpu`` parses and resolves to the CPU."""
    assert _module(name).parse_args(["--device", "cpu"]).device == "cpu"


@pytest.mark.parametrize("name", GPU_BENCHMARKS)
def test_device_bogus_refused(name: str, capsys: pytest.CaptureFixture) -> None:
    """A device that is not a choice stops the parser with argparse's usage error."""
    with pytest.raises(SystemExit) as stop:
        _module(name).parse_args(["--device", "bogus"])
    assert stop.value.code == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("name", GPU_BENCHMARKS)
def test_device_cuda_without_gpu_stops(name: str) -> None:
    """``--device cuda`` without a CUDA device stops at parsing and names the fix."""
    with pytest.raises(SystemExit, match=r"--device cuda: this torch sees no CUDA device.*use --device cpu"):
        _module(name).parse_args(["--device", "cuda"])


@pytest.mark.parametrize("name", GPU_BENCHMARKS)
def test_device_default_is_auto(name: str) -> None:
    """No flag: ``auto``, which is the CPU where torch sees no GPU, as before."""
    assert _module(name).parse_args([]).device == ("cuda" if torch.cuda.is_available() else "cpu")
