"""``Trainer(snapshots=Snapshots(K))``: a run interrupted after a snapshot continues, in a new
Trainer and model (another seed) on the same ranks, from the snapshot in host memory, with no
disk checkpoint (``save_strategy="no"``), mid-epoch, dropout on: its later losses and final
weights are bitwise those of an uninterrupted run without snapshots, at world 2; a finished run
leaves nothing under the snapshots' root."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from harness import run  # noqa: E402
from test_integrations_trainer import Rows, _args, _full, _logged, _model  # noqa: E402

K, STOP_AT, STEPS, ROWS = 3, 5, 8, 48  # 6 steps per epoch at world 2: the snapshot at 3 is mid-epoch


class Interrupted(RuntimeError):
    """The failure the test injects after a step."""


def _trainer(out: str, root: str, job: str, seed: int, stop_at: int = 0):
    import transformers

    from parts.comm import Snapshots
    from parts.integrations.transformers import Trainer

    class Steps(transformers.TrainerCallback):
        """Counts the steps this run trains; raises after step ``stop_at``."""

        def __init__(self) -> None:
            self.trained = 0

        def on_step_end(self, args, state, control, **kwargs):
            self.trained += 1
            if state.global_step == stop_at:
                raise Interrupted(f"interrupted after step {stop_at}")

    snaps = Snapshots(K, job=job, root=root) if job else None
    steps = Steps()
    trainer = Trainer(model=_model(seed=seed), args=_args(out, max_steps=STEPS, save_strategy="no"),
                      train_dataset=Rows(ROWS), snapshots=snaps, callbacks=[steps])
    return trainer, snaps, steps


def uninterrupted(out: str) -> dict:
    trainer, _, _ = _trainer(out, "", "", seed=0)
    trainer.train()
    return {"losses": _logged(trainer, "loss"), "final": _full(trainer.model)}


def interrupted(out: str, root: str, job: str) -> list:
    trainer, snaps, _ = _trainer(out, root, job, seed=0, stop_at=STOP_AT)
    try:
        trainer.train()
    except Interrupted:
        snaps.wait()  # the snapshot being written is committed (a killed run keeps the last committed one)
    return _logged(trainer, "loss")


def restarted(out: str, root: str, job: str) -> dict:
    trainer, _, steps = _trainer(out, root, job, seed=1)
    trainer.train()
    return {"losses": _logged(trainer, "loss"), "trained": steps.trained, "final": _full(trainer.model),
            "left": sorted(os.listdir(root))}


def test_an_interrupted_trainer_continues_from_its_snapshot_bitwise_as_an_uninterrupted_run(tmp_path) -> None:
    root = tmp_path / "shm"
    root.mkdir()
    reference = run(2, uninterrupted, str(tmp_path / "plain"), timeout=180)[0]
    first = run(2, interrupted, str(tmp_path / "a"), str(root), "trainer-job", timeout=180)[0]
    assert first == reference["losses"][:STOP_AT - 1]  # snapshots change nothing (step 5 raised before its log)
    got = run(2, restarted, str(tmp_path / "b"), str(root), "trainer-job", timeout=180)
    assert not [name for out in ("a", "b") if (tmp_path / out).is_dir() for name in os.listdir(tmp_path / out)
                if name.startswith("checkpoint-")]  # nothing on disk to resume from
    for rank, result in enumerate(got):
        assert result["trained"] == STEPS - K, rank  # steps 4..8, from the snapshot at 3
        assert result["losses"] == reference["losses"], rank  # 1..3 in the restored log history, then 4..8
        assert result["left"] == [], rank  # the finished run removed the job's snapshots
        for key, value in reference["final"].items():
            assert result["final"][key].equal(value), (rank, key)
