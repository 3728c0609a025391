"""``save_snapshot`` / ``restore_snapshot``: an accelerate loop on a parts model (a tiny GPT-2 with
dropout, AdamW, a linear schedule) interrupted after a snapshot continues, with a new accelerator
and model (another seed) on the same ranks, from host memory: its later losses and final weights
are bitwise those of an uninterrupted loop without snapshots, at world 2."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from harness import run  # noqa: E402
from test_integrations_accelerate import _fresh_state, _rows, _step  # noqa: E402

K, STOP_AT, STEPS = 3, 5, 8


class Interrupted(RuntimeError):
    """The failure the test injects after a step."""


def _prepared(accelerator, seed: int) -> tuple:
    from transformers import GPT2Config, GPT2LMHeadModel

    from parts.integrations.accelerate import prepare
    from parts.partition import partitioned
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32, resid_pdrop=0.1)
    with partitioned():
        model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=STEPS)
    loader = torch.utils.data.DataLoader(_rows(4 * 2 * STEPS), batch_size=4)
    return prepare(accelerator, model, optimizer, schedule, loader)


def loop(root: str, seed: int, stop_at: int = 0, snapshots: bool = True) -> dict:
    """The training loop (with snapshots every K steps unless told otherwise); its losses and final weights."""
    from parts.comm import Snapshots
    from parts.integrations.accelerate import Accelerator
    from parts.integrations.accelerate_snapshots import restore_snapshot, save_snapshot
    from parts.partition import full_state_dict

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _fresh_state()
    try:
        accelerator = Accelerator(cpu=True)
        model, optimizer, schedule, loader = _prepared(accelerator, seed)
        batches = list(loader)  # iterating draws from the RNG: before the restore puts it back
        snaps = Snapshots(K, job="accelerate-job", root=root) if snapshots else None
        start, position = (restore_snapshot(accelerator, snaps) if snaps else None) or (0, None)
        losses = []
        for step in range(start + 1, STEPS + 1):
            losses.append(_step(accelerator, model, optimizer, schedule, batches[step - 1]))
            if step == stop_at:
                snaps.wait()  # the snapshot being written is committed (a killed loop keeps the last committed one)
                raise Interrupted(f"interrupted after step {step}")
            if snaps is not None and snaps.due(step):
                save_snapshot(accelerator, snaps, step, position={"batch": step})
        if snaps is not None:
            snaps.close()
        return {"start": start, "position": position, "losses": losses,
                "final": full_state_dict(model, rank0_only=False), "left": sorted(os.listdir(root))}
    finally:
        _fresh_state()


def interrupted(root: str) -> str:
    try:
        loop(root, seed=0, stop_at=STOP_AT)
    except Interrupted as stop:
        return str(stop)
    return "not interrupted"


def test_an_interrupted_accelerate_loop_continues_from_its_snapshot_bitwise(tmp_path) -> None:
    root = tmp_path / "shm"
    root.mkdir()
    reference = run(2, loop, str(root), 0, snapshots=False, timeout=120)
    assert run(2, interrupted, str(root), timeout=120) == [f"interrupted after step {STOP_AT}"] * 2
    for rank, got in enumerate(run(2, loop, str(root), 1, timeout=120)):
        assert (got["start"], got["position"]) == (K, {"batch": K}), rank
        assert got["losses"] == reference[rank]["losses"][K:], rank  # steps 4..8, bitwise
        for key, value in reference[rank]["final"].items():
            assert torch.equal(got["final"][key], value), (rank, key)
        assert got["left"] == [], rank  # closed: nothing left in host memory
