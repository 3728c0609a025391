"""``parts.integrations.transformers.Trainer``: transformers' Trainer on a parts model, default knobs.

A tiny GPT-2 (2 layers, 32 wide) built under ``partitioned()`` and trained at world 2 by the
drop-in ``Trainer`` with ``save_strategy="steps"``: its checkpoints hold every rank's shards
(DCP) and resume with bitwise the same later losses (and at world 1 with the same global
batch, to float rounding); the logged grad norm and loss are those of the unsharded model on
the same global batch; ``evaluate`` gives the unsharded model's loss; ``save_model`` writes the
current full weights; ``Seq2SeqTrainer.predict`` with ``predict_with_generate`` generates what
the unsharded model generates.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from harness import run  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Seq2SeqTrainingArguments, TrainingArguments  # noqa: E402

from parts.integrations.transformers import MODEL_DIR, OPTIMIZER_DIR, Seq2SeqTrainer, Trainer  # noqa: E402
from parts.partition import full_state_dict, partitioned  # noqa: E402

VOCAB, SEQ = 97, 16


def _config(dropout: float) -> GPT2Config:
    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)


class Rows(torch.utils.data.Dataset):
    """Learnable token rows ``(a + k * t) % VOCAB`` from a fixed seed; labels are the inputs."""

    def __init__(self, rows: int, seq_len: int = SEQ) -> None:
        g = torch.Generator().manual_seed(0)
        start, step = torch.randint(0, VOCAB, (rows, 1), generator=g), torch.randint(1, 5, (rows, 1), generator=g)
        self.ids = (start + step * torch.arange(seq_len)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model(dropout: float = 0.1, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    with partitioned():
        return GPT2LMHeadModel(_config(dropout))


def _args(out: str, cls: type = TrainingArguments, **overrides) -> TrainingArguments:
    """Trainer's defaults (save_strategy="steps", fused AdamW, linear schedule, clipping at 1.0) but small."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # accelerate warns without it; workers run one thread
    knobs = dict(output_dir=out, max_steps=6, per_device_train_batch_size=4, learning_rate=3e-3, weight_decay=0.1,
                 logging_steps=1, save_steps=3, report_to=[], seed=0, use_cpu=True, disable_tqdm=True)
    return cls(**{**knobs, **overrides})


def _logged(trainer: Trainer, key: str) -> list:
    return [h[key] for h in trainer.state.log_history if key in h]


def _full(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in full_state_dict(model, rank0_only=False).items()}


def _train_then_resume(out: str) -> dict:
    trainer = Trainer(model=_model(), args=_args(os.path.join(out, "a")), train_dataset=Rows(48))
    trainer.train()
    checkpoint = os.path.join(out, "a", "checkpoint-3")
    resumed = Trainer(model=_model(seed=1), args=_args(os.path.join(out, "b")), train_dataset=Rows(48))
    resumed.train(resume_from_checkpoint=checkpoint)
    return dict(losses=_logged(trainer, "loss"), norms=_logged(trainer, "grad_norm"),
                resumed_losses=_logged(resumed, "loss"), resumed_norms=_logged(resumed, "grad_norm"),
                files=sorted(os.listdir(checkpoint)), shards=sorted(os.listdir(os.path.join(checkpoint, OPTIMIZER_DIR))),
                final=_full(trainer.model), resumed_final=_full(resumed.model))


def test_trainer_checkpoints_every_save_steps_and_resumes_with_identical_losses(tmp_path) -> None:
    ranks = run(2, _train_then_resume, str(tmp_path), timeout=120)
    got = ranks[0]
    assert len(got["losses"]) == 6 and got["losses"] == ranks[1]["losses"]
    for name in ("checkpoint-3", "checkpoint-6"):
        assert (tmp_path / "a" / name).is_dir()
    assert {MODEL_DIR, OPTIMIZER_DIR, "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth",
            "trainer_state.json", "config.json"} <= set(got["files"])
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(got["shards"])  # every rank's optimizer shard
    # dropout on: the RNG, data position, optimizer, schedule and weights all came back
    assert got["resumed_losses"] == got["losses"]
    assert got["resumed_norms"] == got["norms"]
    for k, v in got["final"].items():
        assert torch.equal(got["resumed_final"][k], v), k
