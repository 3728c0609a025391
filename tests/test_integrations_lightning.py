"""Lightning's ``Trainer(strategy="parts")`` trains, checkpoints and resumes as ``Trainer(strategy="ddp")`` does.

A tiny GPT LightningModule (lightning_common.py) on 2 and 3 harness ranks: Lightning sees the
launcher's ``LOCAL_RANK`` and uses the process group the harness made. fp32 at world 2: the
grads are averages of two numbers and AdamW is element-wise, so parts' losses are DDP's, bit
for bit, and so is a resumption from a sharded checkpoint. At world 3 the grad sums run in
another order than DDP's (1e-6). Skipped without Lightning (``pip install "parts[lightning]"``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

from harness import run  # noqa: E402
from lightning_common import fit, lightning_run, loader, module_class, trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS, RESUME_AT = 30, 20


def _world2(root: str) -> dict:
    with lightning_run():
        import parts.integrations.lightning  # noqa: F401  registers "parts"
        from parts.partition import full_state_dict
        ddp = fit("ddp", os.path.join(root, "ddp"), STEPS, save=True).losses
        step20 = os.path.join(root, "ddp", "checkpoints", f"epoch=1-step={RESUME_AT}.ckpt")
        ddp_resumed = fit("ddp", os.path.join(root, "ddp_resumed"), STEPS, step20).losses
        parts_first = fit("parts", os.path.join(root, "parts"), RESUME_AT, save=True).losses  # stopped at step 20
        parts = fit("parts", os.path.join(root, "parts"), STEPS, "last", save=True)
        weights = full_state_dict(parts.model)
        parts20 = os.path.join(root, "parts", "checkpoints", f"epoch=1-step={RESUME_AT}.ckpt")
        validated = {name: _validate(name, path, root) for name, path in (("ddp", step20), ("parts", parts20))}
    return dict(ddp=ddp, ddp_resumed=ddp_resumed, parts=parts_first + parts.losses, parts_resumed=parts.losses,
                weights=weights, validated=validated)


def _validate(strategy: str, checkpoint: str, root: str) -> list:
    """``validate(ckpt_path=...)`` of a fresh module: the validation losses of the checkpoint's weights."""
    module = module_class()()
    trainer(strategy, os.path.join(root, "validate"), limit_val_batches=2).validate(
        module, loader(), ckpt_path=checkpoint, verbose=False)
    return module.val_losses


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    root = tmp_path_factory.mktemp("lightning")
    return root, run(2, _world2, str(root), timeout=300)


def test_parts_trains_as_ddp_and_resumes_from_its_sharded_checkpoint_as_ddp_does(world2) -> None:
    _, ranks = world2
    for got in ranks:
        assert len(got["ddp"]) == len(got["parts"]) == STEPS
        assert max(abs(a - b) for a, b in zip(got["parts"], got["ddp"])) <= 1e-6
        assert got["parts"] == got["ddp"]  # the same fp32 math at world 2: bitwise
        assert got["parts_resumed"] == got["ddp_resumed"]  # resumed at step 20, bitwise DDP's resumption
        assert got["ddp_resumed"] == got["ddp"][RESUME_AT:]  # ... which is the uninterrupted run
        assert len(got["validated"]["parts"]) == 2
        assert got["validated"]["parts"] == got["validated"]["ddp"]  # validate(ckpt_path=...) loads the weights
    assert ranks[0]["ddp"] != ranks[1]["ddp"]  # each rank trains on its own rows


def test_a_checkpoint_is_one_dcp_folder_every_rank_writing_its_shards(world2) -> None:
    from parts.comm.dcp_files import read_metadata
    root, _ = world2
    folder = root / "parts" / "checkpoints" / "last.ckpt"
    assert folder.is_dir() and sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    keys = set(read_metadata(folder).state_dict_metadata)
    assert "model.wte.weight" in keys and "parts_lightning" in keys  # weights, and the loops' state
    assert any(k.startswith("parts_optimizer_0.state.model.wte.weight.exp_avg") for k in keys)
    steps = sorted(p.name for p in (root / "parts" / "checkpoints").glob("epoch=*"))
    assert steps == ["epoch=0-step=10.ckpt", "epoch=1-step=20.ckpt", "epoch=2-step=30.ckpt"]


def _world3(root: str, world2_checkpoint: str) -> dict:
    with lightning_run():
        import parts.integrations.lightning  # noqa: F401
        resumed = fit("parts", os.path.join(root, "resumed"), STEPS, world2_checkpoint).losses
        uninterrupted = fit("parts", os.path.join(root, "uninterrupted"), STEPS).losses
    return dict(resumed=resumed, uninterrupted=uninterrupted)


def _mean_over_ranks(ranks: list, key: str) -> list:
    return [sum(step) / len(step) for step in zip(*(r[key] for r in ranks))]


def test_a_world2_checkpoint_resumes_at_world3_as_an_uninterrupted_world3_run(world2, tmp_path) -> None:
    root, ranks2 = world2
    checkpoint = root / "parts" / "checkpoints" / f"epoch=1-step={RESUME_AT}.ckpt"
    ranks3 = run(3, _world3, str(tmp_path), str(checkpoint), timeout=300)
    # every step has the same 12 rows at world 2 and 3: the mean loss over ranks is the step's loss
    world2_losses, uninterrupted = _mean_over_ranks(ranks2, "parts"), _mean_over_ranks(ranks3, "uninterrupted")
    resumed = _mean_over_ranks(ranks3, "resumed")
    assert len(resumed) == STEPS - RESUME_AT
    # fp32 sums over 2 and 3 ranks round differently; AdamW's normalised steps carry it on (~1e-5)
    assert resumed == pytest.approx(uninterrupted[RESUME_AT:], rel=5e-5)
    assert uninterrupted == pytest.approx(world2_losses, rel=5e-5)  # the data are world-size free
    assert resumed != uninterrupted[:STEPS - RESUME_AT]  # it went on from step 20, not from the start


@pytest.mark.slow
def test_python_m_parts_export_writes_the_model_of_a_checkpoint_folder(world2, tmp_path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    root, ranks = world2
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "parts.export", str(root / "parts" / "checkpoints" / "last.ckpt"),
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    exported = safetensors.load_file(str(out / "model.safetensors"))  # the weights at step 30, last.ckpt's
    trained = ranks[0]["weights"]
    assert sorted(exported) == sorted(trained)  # the GPT's own keys: the module's "model." left out
    assert all(torch.equal(exported[k], trained[k]) for k in trained)


@pytest.mark.slow
def test_under_torchrun_trainer_init_module_starts_the_group_and_shards_at_construction(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "tests" / "lightning_job.py"), str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("result "))[len("result "):])
    assert result["group_before"] is False and result["sharded"] is True
    assert len(result["losses"]) == 3
