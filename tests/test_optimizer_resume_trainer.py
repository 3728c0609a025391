"""The drop-in Trainer resumes whole-path optimizers into fresh, never-stepped ones: ``optim="adafactor"``
and a Muon + AdamW optimizer passed through ``optimizers=``, checkpointed at world 2 after 3 of 6
steps, resumed at world 3 and at world 2 from a fresh model; the losses and final weights equal
transformers' own Trainer resuming the unsharded model from its own checkpoint, one process, the
same global batch (a float64 model; Trainer logs its losses in float32)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from harness import run  # noqa: E402
from test_integrations_trainer import Rows, _args, _logged  # noqa: E402
from test_optimizer_resume import MuonAdamW  # noqa: E402
from test_whole_optim import _ns_in_grad_dtype  # noqa: E402

VOCAB, WIDTH, GLOBAL_BATCH, RTOL, LOGGED_RTOL = 97, 12, 12, 1e-9, 3e-7


class TinyLM(torch.nn.Module):
    """Embedding, a tanh layer and a head (float64): next-token cross-entropy over the row."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.hidden = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
        logits = self.head(torch.tanh(self.hidden(self.embed(input_ids))))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}


def _model(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM().double()


def _knobs(out: str, optim: str, world: int):
    return _args(out, max_steps=6, save_steps=3, learning_rate=1e-2, weight_decay=0.0, lr_scheduler_type="constant",
                 per_device_train_batch_size=GLOBAL_BATCH // world,
                 **({"optim": "adafactor"} if optim == "adafactor" else {}))


def _train(trainer_cls, model, out: str, optim: str, world: int, checkpoint) -> tuple:
    """Train (or resume from ``checkpoint``); the logged losses and the final weights."""
    restore = _ns_in_grad_dtype([])
    try:
        optimizers = (None, None)
        if optim == "muon+adamw":
            from parts.partition import is_partitioned, route, shards
            sharded = any(is_partitioned(p) for p in model.parameters())
            optimizer = MuonAdamW(shards(model) if sharded else model.parameters())
            if sharded:
                route(optimizer, "whole")  # Muon needs whole matrices, and AdamW is exact on them too
            optimizers = (optimizer, None)
        trainer = trainer_cls(model=model, args=_knobs(out, optim, world), train_dataset=Rows(6 * GLOBAL_BATCH),
                              optimizers=optimizers)
        trainer.train(resume_from_checkpoint=checkpoint)
        return _logged(trainer, "loss"), trainer
    finally:
        restore()


def parts_body(out: str, optim: str, checkpoint) -> tuple:
    """The drop-in Trainer at this world size from a fresh sharded model (seed 1 when resuming)."""
    import torch.distributed as dist

    from parts.integrations.transformers import Trainer
    from parts.partition import full_state_dict, partition_module
    model = partition_module(_model(0 if checkpoint is None else 1))
    losses, trainer = _train(Trainer, model, out, optim, dist.get_world_size(), checkpoint)
    return losses, full_state_dict(trainer.model, rank0_only=False)


def plain_body(out: str, optim: str) -> tuple:
    """transformers' own Trainer, one process: 6 steps saving after 3, then a fresh model resuming there."""
    import transformers
    _train(transformers.Trainer, _model(0), os.path.join(out, "first"), optim, 1, None)
    losses, trainer = _train(transformers.Trainer, _model(1), os.path.join(out, "again"), optim, 1,
                             os.path.join(out, "first", "checkpoint-3"))
    return losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("optim", ["adafactor", "muon+adamw"])
def test_trainer_resumes_a_fresh_whole_path_optimizer_as_transformers_trainer_does(tmp_path, optim: str) -> None:
    plain_losses, plain_final = run(1, plain_body, str(tmp_path / "plain"), optim, timeout=300)[0]
    run(2, parts_body, str(tmp_path / "w2"), optim, None, timeout=300)
    checkpoint = str(tmp_path / "w2" / "checkpoint-3")
    for world in (3, 2):
        losses, final = run(world, parts_body, str(tmp_path / f"again{world}"), optim, checkpoint, timeout=300)[0]
        assert len(losses) == len(plain_losses) == 6, (losses, plain_losses)  # 3 from the trainer state
        # Trainer sums the logged loss in float32: equal to its rounding; the float64 weights to 1e-9
        assert losses == pytest.approx(plain_losses, rel=LOGGED_RTOL, abs=0), (world, losses, plain_losses)
        for k, v in plain_final.items():
            assert float((final[k] - v).norm() / v.norm()) < RTOL, (world, k)
