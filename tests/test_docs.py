"""Every Python code block of README.md and docs/*.md runs.

A block whose first line is ``# torchrun --nproc-per-node N`` runs on N gloo ranks of the
harness (its ``dist.init_process_group(...)`` line finds the group already made); any other
``python`` block runs in this process. Each block runs alone, in a fresh namespace, inside a
temporary directory, so that a block a reader copies works as it stands.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from harness import run

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
TORCHRUN = re.compile(r"#\s*torchrun --nproc-per-node (\d+)")


def blocks() -> list[tuple[str, int, str]]:
    """(page, line, source) of every ```python block of the README and the guides."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((str(page.relative_to(ROOT)), line, match.group(1)))
    return found


def world_of(source: str) -> int:
    """The rank count a block names on its first line, or 0 for a single-process block."""
    first = source.lstrip().splitlines()[0] if source.strip() else ""
    match = TORCHRUN.match(first)
    return int(match.group(1)) if match else 0


@contextlib.contextmanager
def _inside(directory: str):
    before = os.getcwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(before)


def _exec(source: str, name: str, directory: str) -> None:
    """Run ``source`` as a script named ``name`` with ``directory`` as the working directory (a
    Lightning block as lightning_common.lightning_run runs Lightning: its own warnings aside)."""
    with _inside(directory), (_lightning_run() if "lightning" in _needs(source) else contextlib.nullcontext()):
        exec(compile(source, name, "exec"), {"__name__": "__main__"})


def _lightning_run() -> contextlib.AbstractContextManager:
    from lightning_common import lightning_run
    return lightning_run()


def _exec_on_rank(source: str, name: str, directory: str) -> bool:
    """One rank of a torchrun block: the harness made the process group already."""
    made = dist.init_process_group
    dist.init_process_group = lambda *args, **kwargs: None  # the block's own call: the group exists
    try:
        _exec(source, name, directory)
    finally:
        dist.init_process_group = made
    return True


BLOCKS = blocks()


def test_the_pages_have_python_blocks():
    assert len(BLOCKS) >= 10, [b[:2] for b in BLOCKS]


OPTIONAL = {"transformers": "transformers", "accelerate": "accelerate", "safetensors": "safetensors",
            "parts.integrations": "accelerate",  # the [hf] extra
            "lightning": "lightning"}  # the [lightning] extra


def _needs(source: str) -> list[str]:
    """The optional libraries a block imports (skipped without them, as the [hf] tests are)."""
    return sorted({lib for name, lib in OPTIONAL.items()
                   if re.search(rf"^\s*(from|import) {re.escape(name)}\b", source, re.M)})


@pytest.mark.parametrize("page,line,source", BLOCKS, ids=[f"{p}:{n}" for p, n, _ in BLOCKS])
def test_block_runs(page: str, line: int, source: str, tmp_path: Path) -> None:
    for lib in _needs(source):
        pytest.importorskip(lib)
    name = f"{page}:{line}"
    world = world_of(source)
    if world:
        assert run(world, _exec_on_rank, source, name, str(tmp_path), timeout=120.0) == [True] * world
    else:
        _exec(source, name, str(tmp_path))


def _render(*args: str) -> subprocess.CompletedProcess:
    script = ROOT / "benchmarks" / "render_results.py"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60)


def test_results_md_and_the_readme_table_are_rendered_from_the_recorded_runs() -> None:
    done = _render("--check")
    assert done.returncode == 0, done.stderr


def test_render_writes_each_bench_latest_run_with_its_command_and_machine(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    run_of = {"bench": "bench_zero3", "machine": {"cpu": "CPU X", "cores": 2}, "torch": "2.13.0",
              "command": "python benchmarks/bench_zero3.py --rounds 1",
              "results": {"rows": [{"system": "ddp", "step_s": 1.5}, {"system": "parts", "step_s": 1.25}]}}
    older = {**run_of, "results": {"rows": [{"system": "ddp", "step_s": 9.0}]}}
    (results / "bench_zero3.jsonl").write_text(json.dumps(older) + "\n" + json.dumps(run_of) + "\n")
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results -->\nold\n<!-- /results -->\nend\n")
    out = tmp_path / "RESULTS.md"
    assert _render("--results", str(results), "--output", str(out), "--readme", str(readme)).returncode == 0
    text = out.read_text()
    assert "`python benchmarks/bench_zero3.py --rounds 1`" in text and "CPU X, 2 cores" in text
    assert "| parts | 1.25 |" in text and "9.0" not in text
    assert "| parts | 1.25 |" in readme.read_text() and "old" not in readme.read_text()
    assert _render("--check", "--results", str(results), "--output", str(out), "--readme", str(readme)).returncode == 0
