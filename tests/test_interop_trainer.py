"""parts' drop-in ``Trainer`` on a sharded model equals transformers' own DDP ``Trainer``.

Launches ``recipes/hf_trainer.py --compare-ddp`` under torchrun at world 2, as a user runs
it: a tiny GPT-2 (dropout on, weight decay 0.1, Trainer's default fused AdamW and linear
schedule), 4 steps of transformers' ``Trainer`` (DDP) and of
``parts.integrations.transformers.Trainer`` on the same seeds and global batch, with
clipping at 0.5 (active: every step's norm is above it) and without.
Skipped without transformers (``pip install "parts[hf]"``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]


def _launch() -> list:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "recipes" / "hf_trainer.py"), "--compare-ddp", "--steps", "4"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("compare "))
    return json.loads(line[len("compare "):])


@pytest.mark.slow
def test_trainer_on_parts_equals_ddp_trainer() -> None:
    clipped, unclipped = _launch()
    for run in (clipped, unclipped):
        assert run["keys_equal"] and run["saved_equal"]  # save_model wrote the trained weights
        assert len(run["parts"]) == len(run["ddp"]) == 4
        for (loss, norm), (ref_loss, ref_norm) in zip(run["parts"], run["ddp"]):
            # the global grad norm is summed in another order than torch's per-tensor norms
            assert norm == pytest.approx(ref_norm, rel=1e-5)
            assert loss == pytest.approx(ref_loss, rel=0, abs=1e-6)
    assert all(norm > clipped["max_grad_norm"] for _, norm in clipped["ddp"])  # clipping acts
    # no clipping: the same fp32 math (grads averaged over 2 ranks, elementwise AdamW on
    # shards): final parameters bitwise equal
    assert unclipped["param_diff"] == 0.0
    assert [loss for loss, _ in unclipped["parts"]] == [loss for loss, _ in unclipped["ddp"]]
    # clipping scales by max_norm / norm of that norm: a 1e-7 relative difference per step
    assert clipped["param_diff"] < 2e-6
