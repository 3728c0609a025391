"""parts.io: save only writes what load accepts (checked at save time)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from parts import io as pio


@pytest.mark.parametrize("value, fragment", [
    (argparse.Namespace(lr=0.1), "obj['args'] is a argparse.Namespace"),
    (Path("/tmp/x"), "obj['args'] is a pathlib.PosixPath"),
    ({1, 2}, "obj['args'] is a builtins.set"),
])
def test_save_refuses_values_load_would_refuse(tmp_path: Path, value: object, fragment: str) -> None:
    """A TypeError naming the value, and no file written (nothing unloadable is saved)."""
    with pytest.raises(TypeError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        pio.save({"w": torch.ones(2), "args": value}, tmp_path / "ck.pt")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("obj", [
    {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}},
    {0: torch.ones(1), "0": torch.zeros(1)},
])
def test_save_refuses_tensor_names_that_collide(tmp_path: Path, obj: dict) -> None:
    """Two tensors with one manifest name cannot be verified on load: refused at save."""
    with pytest.raises(ValueError, match="two tensors are both named"):
        pio.save(obj, tmp_path / "ck.pt")
    assert not any(tmp_path.iterdir())


def test_save_accepts_what_load_accepts(tmp_path: Path) -> None:
    """Plain state: saved and loaded back equal (the check refuses nothing loadable here)."""
    obj = {"model": {"w": torch.arange(4.0)}, "step": 3, "lr": 1e-3, "name": "run", "none": None,
           "shape": torch.Size([2]), "dtype": torch.bfloat16, "nested": [(1, 2.0), {"k": b"x"}]}
    pio.save(obj, tmp_path / "ck.pt")
    back = pio.load(tmp_path / "ck.pt")
    assert torch.equal(back["model"]["w"], obj["model"]["w"])
    assert {k: v for k, v in back.items() if k != "model"} == {k: v for k, v in obj.items() if k != "model"}


def test_save_writes_mode_0644_and_removes_stale_temporaries(tmp_path: Path) -> None:
    """Files get open()'s mode (0644 under umask 022, as torch.save), not mkstemp's 0600;
    a temporary left by a killed save (its pid gone) is removed, a live writer's is kept."""
    import os
    stale = tmp_path / ".ck.pt.999999999.x1.tmp"  # no such pid
    live = tmp_path / f".ck.pt.{os.getppid()}.x2.tmp"
    stale.write_bytes(b"torn"), live.write_bytes(b"writing")
    old = os.umask(0o022)
    try:
        pio.save({"w": torch.ones(2)}, tmp_path / "ck.pt")
    finally:
        os.umask(old)
    assert (tmp_path / "ck.pt").stat().st_mode & 0o777 == 0o644
    assert not stale.exists() and live.exists()


def test_save_streams_and_load_holds_what_torch_load_holds() -> None:
    """A 64 MiB checkpoint: save streams (no in-memory copy of the payload) and adds at most
    16 MiB of peak RSS; load adds at most 16 MiB (its 8 MiB read buffer) over what torch.load
    adds (no second copy of the file bytes)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "tests" / "io_memory_job.py"), "64"], cwd=root,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, timeout=240, check=True).stdout
    save, plain, ours = map(int, out.split())
    slack = 16 << 20
    assert plain >= 48 << 20, out  # the measurement sees the loaded tensors at all
    assert save <= slack, f"save grew peak RSS by {save / 2**20:.0f} MiB"
    assert ours <= plain + slack, f"load {ours / 2**20:.0f} MiB vs torch.load {plain / 2**20:.0f} MiB"
