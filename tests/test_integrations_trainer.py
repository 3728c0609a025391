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
from parts.partition import full_state_dict, partition_module, partitioned  # noqa: E402

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
                files=sorted(os.listdir(checkpoint)),
                shards=sorted(os.listdir(os.path.join(checkpoint, OPTIMIZER_DIR))),
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


class Recording(Trainer):
    """The Trainer, keeping each training step's inputs to replay them on the unsharded model."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen = getattr(self, "seen", []) + [inputs["input_ids"].clone()]
        return super().training_step(model, inputs, num_items_in_batch)


def _global(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor``, concatenated in rank order."""
    import torch.distributed as dist
    every = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(every, tensor)
    return torch.cat(every)


def _plain(state: dict) -> GPT2LMHeadModel:
    model = GPT2LMHeadModel(_config(0.0))
    model.load_state_dict(state)
    return model


def _norm_eval_save(out: str) -> dict:
    from safetensors.torch import load_file

    from parts.partition import attach
    from parts.partition.coordinator import attached_to

    model = _model(dropout=0.0)
    coordinator = attach(model)  # attached by the user: the Trainer keeps it
    initial = _full(model)
    trainer = Recording(model=model, args=_args(out, max_steps=2, max_grad_norm=0.5), train_dataset=Rows(16),
                        eval_dataset=Rows(16, seq_len=12))
    trainer.train()
    kept = attached_to(model) is coordinator and trainer.model_wrapped is model  # no DDP around it
    batch = _global(trainer.seen[0])  # step 1's global batch on the unsharded model
    reference = _plain(initial)
    # Trainer divides the summed token losses by the label count over every rank (all 16 per row
    # for GPT-2, whose loss shifts them), as the DDP Trainer does; the reference does the same
    loss = reference(input_ids=batch, labels=batch, num_items_in_batch=torch.tensor(batch.numel())).loss
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    final = _full(trainer.model)
    eval_rows = Rows(16, seq_len=12).ids
    with torch.no_grad():
        eval_loss = _plain(final)(input_ids=eval_rows, labels=eval_rows,
                                  num_items_in_batch=torch.tensor(eval_rows.numel())).loss
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(out, "final"))
    import torch.distributed as dist
    dist.barrier()  # rank 0 wrote it
    saved = load_file(os.path.join(out, "final", "model.safetensors"))
    loaded = GPT2LMHeadModel.from_pretrained(os.path.join(out, "final")).state_dict()
    return dict(kept=kept, logged_loss=_logged(trainer, "loss")[0], loss=loss.item(),
                logged_norm=_logged(trainer, "grad_norm")[0],
                norm=norm.item(), eval_loss=metrics["eval_loss"], ref_eval_loss=eval_loss.item(),
                saved_keys_equal=all(torch.equal(v, final[k]) for k, v in saved.items()),
                loaded_equal=sorted(loaded) == sorted(final) and all(torch.equal(loaded[k], final[k]) for k in final),
                moved=max(float((final[k] - initial[k]).abs().max()) for k in final))


def test_trainer_logs_the_unsharded_grad_norm_evaluates_and_saves_current_full_weights(tmp_path) -> None:
    for got in run(2, _norm_eval_save, str(tmp_path), timeout=120):
        assert got["kept"]
        # the global norm sums per-shard squares in another order than torch's per-tensor norms
        assert got["logged_norm"] == pytest.approx(got["norm"], rel=1e-5)
        assert got["norm"] > 0.5  # max_grad_norm clipped step 1
        assert got["logged_loss"] == pytest.approx(got["loss"], rel=0, abs=1e-6)
        assert got["eval_loss"] == pytest.approx(got["ref_eval_loss"], rel=0, abs=1e-6)
        assert got["moved"] > 0  # two steps changed the weights that were saved
        assert got["saved_keys_equal"] and got["loaded_equal"]


def _resume_at(out: str, checkpoint: str | None, batch: int) -> list:
    if checkpoint is None:
        model = _model(dropout=0.0)
    else:  # built whole and sharded afterwards: the checkpoint's weights replace its own
        torch.manual_seed(1)
        model = partition_module(GPT2LMHeadModel(_config(0.0)))
    trainer = Trainer(model=model, args=_args(out, per_device_train_batch_size=batch), train_dataset=Rows(72))
    trainer.train(resume_from_checkpoint=checkpoint)
    return _logged(trainer, "loss")


def test_trainer_takes_only_sharded_models() -> None:
    with pytest.raises(TypeError, match="partitioned"):
        Trainer(model=torch.nn.Linear(2, 2))


def test_trainer_resumes_a_world_2_checkpoint_at_world_1(tmp_path) -> None:
    first = run(2, _resume_at, str(tmp_path / "w2"), None, 6, timeout=120)[0]  # global batch 12
    resumed = run(1, _resume_at, str(tmp_path / "w1"), str(tmp_path / "w2" / "checkpoint-3"), 12, timeout=120)[0]
    assert resumed[:3] == first[:3]  # trainer state came back
    # the same global batches on one rank: sums in another order, so float rounding only
    assert resumed[3:] == pytest.approx(first[3:], rel=0, abs=2e-6)


class Prompts(torch.utils.data.Dataset):
    """Prompts of 8 tokens with no end-of-text token (0) in them."""

    def __init__(self) -> None:
        self.ids = Rows(8, seq_len=8).ids % (VOCAB - 1) + 1

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i]}


def _generate(out: str) -> dict:
    args = _args(out, cls=Seq2SeqTrainingArguments, max_steps=1, predict_with_generate=True,
                 per_device_eval_batch_size=4)
    trainer = Seq2SeqTrainer(model=_model(dropout=0.0), args=args, train_dataset=Rows(8))
    trainer.train()
    predictions = torch.as_tensor(trainer.predict(Prompts(), max_new_tokens=6).predictions)
    reference = _plain(_full(trainer.model)).generate(Prompts().ids, max_new_tokens=6, do_sample=False)
    return dict(predictions=predictions, reference=reference)


def test_seq2seq_trainer_predict_with_generate_equals_the_unsharded_model(tmp_path) -> None:
    for got in run(2, _generate, str(tmp_path), timeout=120):
        width = got["reference"].shape[1]
        assert torch.equal(got["predictions"][:, :width], got["reference"])


def _bf16(out: str) -> dict:
    from accelerate.state import AcceleratorState, GradientState

    from parts.partition.coordinator import attached_to

    AcceleratorState._reset_state()  # accelerate keeps one mixed precision per process; these workers outlive a test
    try:
        model = _model(dropout=0.0)
        initial = _full(model)
        trainer = Recording(model=model, args=_args(out, max_steps=1, bf16=True), train_dataset=Rows(8))
        trainer.train()
        with pytest.raises(ValueError, match="mixed_precision='fp16' has no parts counterpart"):
            Trainer(model=_model(), args=_args(out, fp16=True), train_dataset=Rows(8))
    finally:
        AcceleratorState._reset_state()
        GradientState._reset_state()
    batch = _global(trainer.seen[0])
    fp32 = _plain(initial)(input_ids=batch, labels=batch, num_items_in_batch=torch.tensor(batch.numel())).loss
    return dict(dtype=attached_to(model).mixed_precision.param_dtype, loss=_logged(trainer, "loss")[0],
                fp32=fp32.item())


def test_trainer_bf16_trains_under_mixed_precision_and_fp16_raises(tmp_path) -> None:
    for got in run(2, _bf16, str(tmp_path), timeout=120):
        assert got["dtype"] == torch.bfloat16
        assert got["loss"] != got["fp32"]  # computed in bf16, not silently fp32
        assert got["loss"] == pytest.approx(got["fp32"], rel=0, abs=0.05)
