"""The main recipe with ``--snapshot-every K`` under ``torchrun --max-restarts 1``: a worker
SIGKILLed mid-run, no disk checkpoint to read, and the group torchrun's agent restarts
continues from the newest host-memory snapshot to final weights bitwise equal to an
uninterrupted run's, recomputing fewer than K steps; nothing is left in host memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
K, KILL_AT, STEPS = 10, 23, 40
FLAGS = ["--steps", str(STEPS), "--dtype", "fp32", "--snapshot-every", str(K), "--plot", "", "--sample-chars", "5",
         "--eval-interval", "1000", "--eval-batches", "1"]


def launch(out: Path, restarts: int, env: dict) -> subprocess.Popen:
    """``torchrun --standalone --nproc-per-node 2 recipes/train_gpt.py`` with the flags above."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", str(restarts), "--monitor-interval", "0.1", str(ROOT / "recipes" / "train_gpt.py"),
               *FLAGS, "--out", str(out)]
    return subprocess.Popen(command, env=env, cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def weights(path: Path) -> dict:
    """Every value of the DCP checkpoint at ``path``, by its flattened key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(path, path.with_suffix(".pt"))
    flat: dict = {}

    def walk(value, prefix):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = value
    walk(torch.load(path.with_suffix(".pt"), weights_only=False), "")
    return flat


@pytest.mark.slow
def test_a_killed_worker_restarts_from_host_memory_to_the_uninterrupted_runs_weights(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    plain = launch(tmp_path / "plain", 0, {})
    killed = launch(tmp_path / "killed", 1, {"PARTS_RECIPE_FAIL": f"kill:1:{KILL_AT}",
                                             "PARTS_RECIPE_EVENTS": str(events)})
    outputs = [job.communicate(timeout=600)[0] for job in (plain, killed)]
    assert plain.returncode == 0 and killed.returncode == 0, outputs[1][-3000:]
    seen = [json.loads(line) for line in events.read_text().splitlines()]
    restored = [e for e in seen if e["event"] == "restored"]
    assert [e["restart"] for e in seen if e["event"] == "fail"] == [0]
    assert sorted(e["rank"] for e in restored) == [0, 1] and all(e["restart"] == 1 for e in restored), seen
    assert all(e["step"] == KILL_AT - KILL_AT % K and e["disk_bytes"] == 0 for e in restored), restored
    assert 0 < KILL_AT - restored[0]["step"] <= K
    assert not Path(restored[0]["folder"]).exists()  # the clean finish removed the job's snapshots
    a, b = weights(tmp_path / "plain"), weights(tmp_path / "killed")
    assert sorted(a) == sorted(b) and len(a) > 100
    for key in a:
        same = torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]
        assert same, key
