"""``parts.integrations.accelerate``: an accelerate training loop on a parts model, no private attributes.

``Accelerator(mixed_precision="bf16")`` and ``prepare(accelerator, model, optimizer, loader)``
train a tiny GPT-2 built under ``partitioned()`` at world 2 exactly as parts does by hand with
``attach(model, mixed_precision=MixedPrecision())`` (bitwise the same losses and grad norms),
and not as fp32; the model is not wrapped in DDP; mixed precision parts cannot honour raises.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from harness import run  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from parts.integrations.accelerate import Accelerator, mixed_precision_policy, prepare  # noqa: E402
from parts.partition import MixedPrecision, attach, clip_grad_norm_, partitioned, shards  # noqa: E402
from parts.partition.coordinator import attached_to  # noqa: E402

VOCAB, STEPS = 97, 3


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    with partitioned():
        return GPT2LMHeadModel(config)


def _rows(n: int = 4 * 2 * STEPS) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    start, step = torch.randint(0, VOCAB, (n, 1), generator=g), torch.randint(1, 5, (n, 1), generator=g)
    return (start + step * torch.arange(16)) % VOCAB


def _fresh_state() -> None:
    """accelerate keeps one process-wide mixed-precision state; these workers outlive a test."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state()
    GradientState._reset_state()


def _accelerate_loop() -> tuple:
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # as a user writes it
    loader = torch.utils.data.DataLoader(_rows(), batch_size=4)
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader)
    batches, losses, norms = [], [], []
    for ids in loader:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.5).item())
        optimizer.step()
        optimizer.zero_grad()
        batches.append(ids)
        losses.append(loss.item())
    return model, batches, losses, norms


def _by_hand(batches: list, mixed_precision) -> tuple:
    model = _model()
    attach(model, mixed_precision=mixed_precision)
    optimizer = torch.optim.AdamW(shards(model), lr=3e-3)
    losses, norms = [], []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(clip_grad_norm_(model, 0.5).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _bf16_loop() -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # accelerate warns without it; workers run one thread
    _fresh_state()
    try:
        model, batches, losses, norms = _accelerate_loop()
        policy = attached_to(model).mixed_precision
        plain = _model()
        attach(plain)  # attached by the user, fp32: a bf16 accelerator must refuse it
        with pytest.raises(ValueError, match="would compute in fp32"):
            prepare(Accelerator(mixed_precision="bf16", cpu=True), plain)
    finally:
        _fresh_state()
    return dict(type=type(model).__name__, param_dtype=policy.param_dtype, losses=losses, norms=norms,
                by_hand=_by_hand(batches, MixedPrecision()), fp32=_by_hand(batches, None)[0])


def test_accelerate_bf16_loop_is_parts_mixed_precision_without_ddp() -> None:
    for got in run(2, _bf16_loop, timeout=120):
        assert got["type"] == "GPT2LMHeadModel"  # not DistributedDataParallel
        assert got["param_dtype"] == torch.bfloat16
        assert len(got["losses"]) == STEPS
        assert (got["losses"], got["norms"]) == got["by_hand"]  # bitwise
        assert all(n > 0.5 for n in got["norms"])  # clipping acted
        assert got["losses"][1:] != got["fp32"][1:]  # bf16 compute, not fp32


def test_mixed_precision_without_a_parts_counterpart_raises() -> None:
    assert mixed_precision_policy("no") is None
    assert mixed_precision_policy("bf16") == MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for mode in ("fp16", "fp8"):
        with pytest.raises(ValueError, match=f"mixed_precision='{mode}' has no parts counterpart"):
            mixed_precision_policy(mode)


def _step(accelerator, model, optimizer, schedule, ids) -> float:
    """One step of a language model on ``ids`` through accelerate; its loss."""
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad()
    return loss.item()


def _steps(accelerator, model, optimizer, schedule, batches) -> list:
    return [_step(accelerator, model, optimizer, schedule, ids) for ids in batches]


def _prepared(accelerator, seed: int) -> tuple:
    torch.manual_seed(seed)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=4)
    loader = torch.utils.data.DataLoader(_rows(4 * 2 * 4), batch_size=4)
    return prepare(accelerator, model, optimizer, schedule, loader)


def _save_then_load(out: str) -> dict:
    from parts.partition import full_state_dict

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _fresh_state()
    try:
        accelerator = Accelerator(cpu=True)
        model, optimizer, schedule, loader = _prepared(accelerator, 0)
        batches = list(loader)
        first = _steps(accelerator, model, optimizer, schedule, batches[:2])
        location = accelerator.save_state(out)
        later = _steps(accelerator, model, optimizer, schedule, batches[2:])
        final = full_state_dict(model, rank0_only=False)
        again = accelerate.Accelerator(cpu=True)  # accelerate's own: prepare() gives it the parts overrides
        model2, optimizer2, schedule2, loader2 = _prepared(again, 1)
        again.load_state(location)
        resumed = _steps(again, model2, optimizer2, schedule2, list(again.skip_first_batches(loader2, 2)))
        resumed_final = full_state_dict(model2, rank0_only=False)
    finally:
        _fresh_state()
    return dict(first=first, later=later, resumed=resumed, files=sorted(os.listdir(location)),
                same_weights=all(torch.equal(resumed_final[k], v) for k, v in final.items()))


def test_accelerate_save_state_holds_every_rank_shard_and_load_state_resumes_identically(tmp_path) -> None:
    for got in run(2, _save_then_load, str(tmp_path / "state"), timeout=120):
        assert {"parts_model_0", "parts_optimizer_0_0"} <= set(got["files"])
        assert not any(f.startswith("model") for f in got["files"])  # no rank-0 state_dict of the parts model
        assert len(got["later"]) == 2 and got["resumed"] == got["later"]  # bitwise
        assert got["same_weights"]


def _same_batches(accelerator, model, optimizer, schedule, steps: int) -> list:
    """Every rank steps on the same global batch: the mean grad is that batch's at any world size."""
    rows = _rows(4 * steps)
    return _steps(accelerator, model, optimizer, schedule, [rows[4 * i:4 * i + 4] for i in range(steps)])


def _resumable(seed: int) -> tuple:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _fresh_state()
    accelerator = Accelerator(cpu=True)
    return (accelerator, *_prepared(accelerator, seed)[:3])


def _save_at(out: str) -> list:
    try:
        accelerator, model, optimizer, schedule = _resumable(0)
        _same_batches(accelerator, model, optimizer, schedule, 2)
        accelerator.save_state(out)
        return _same_batches(accelerator, model, optimizer, schedule, 4)[2:]
    finally:
        _fresh_state()


def _load_at(out: str) -> list:
    try:
        accelerator, model, optimizer, schedule = _resumable(1)
        accelerator.load_state(out)
        return _same_batches(accelerator, model, optimizer, schedule, 4)[2:]
    finally:
        _fresh_state()


def test_accelerate_load_state_resumes_at_another_world_size(tmp_path) -> None:
    for saved_at, loaded_at in ((2, 3), (2, 1), (3, 2)):
        out = str(tmp_path / f"from{saved_at}")
        if not os.path.exists(out):
            later = run(saved_at, _save_at, out, timeout=120)[0]
        for resumed in run(loaded_at, _load_at, out, timeout=120):
            # the same global batches over another number of ranks: the mean grad rounds differently
            assert resumed == pytest.approx(later, rel=0, abs=2e-6), (saved_at, loaded_at)
