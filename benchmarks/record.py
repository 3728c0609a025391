"""Benchmark results as JSON lines: every benchmark appends its rows here, and
``render_results.py`` turns them into ``RESULTS.md``.

Each line of ``benchmarks/results/<bench>.jsonl`` is one run of one benchmark::

    {"bench": "bench_zero3", "machine": {"cpu": "...", "cores": 2}, "torch": "2.13.0+cpu",
     "command": "python benchmarks/bench_zero3.py --rounds 3", "results": {...}}

``results`` is the benchmark's own table: a dict of plain numbers and strings.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def cpu_model() -> str:
    """The CPU's model name as the OS reports it (``lscpu``'s "Model name")."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """What a reader needs to compare two runs: CPU model and the cores this process may use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_model(), "cores": cores, "system": platform.system()}


def command_line() -> str:
    """The command that produced this run, as a user would retype it (torchrun's when under it)."""
    script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else "?"
    nproc = os.environ.get("LOCAL_WORLD_SIZE") if "TORCHELASTIC_RUN_ID" in os.environ else None
    launcher = ["torchrun", "--standalone", "--nproc-per-node", nproc] if nproc else ["python"]
    return shlex.join([*launcher, script, *sys.argv[1:]])


def record(bench: str, results: dict[str, Any], *, command: Optional[str] = None,
           directory: Optional[Path] = None) -> Path:
    """Append one run of ``bench`` to ``results/<bench>.jsonl``; returns the file."""
    import torch

    row = {"bench": bench, "machine": machine(), "torch": torch.__version__,
           "command": command or command_line(), "results": results}
    out = (directory or RESULTS_DIR) / f"{bench}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")  # key order kept: it is the column order
    return out
