"""The drop-in ``Trainer`` on a 2 x 2 hybrid layout with gradient accumulation equals transformers'
own DDP ``Trainer`` at world 4, and sends its cross-replica mean once per optimizer step (its
accumulation steps run under ``no_sync`` through the accelerator)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from harness import run  # noqa: E402
from test_integrations_trainer import Rows, _args, _config, _full, _logged  # noqa: E402

ACCUMULATION, STEPS = 4, 2


def _accumulating(out: str, hybrid: bool) -> dict:
    """Two steps of 4 micro-batches of 2 rows per rank: parts' Trainer on a 2 x 2 mesh, or DDP's."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import GPT2LMHeadModel

    from parts.comm import comm_counter
    from parts.comm.counter import ledger_since
    from parts.integrations.transformers import Trainer
    from parts.partition import meta, partitioned
    args = _args(out, max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=ACCUMULATION,
                 save_strategy="no")
    torch.manual_seed(0)
    if hybrid:
        with partitioned(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))):
            model = GPT2LMHeadModel(_config(0.0))
        trainer = Trainer(model=model, args=args, train_dataset=Rows(64))
    else:
        model = GPT2LMHeadModel(_config(0.0))
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(64))
    before = comm_counter.by_group()
    trainer.train()
    shard_bytes = sum(4 * meta(p).layout.shard_numel for p in model.parameters()) if hybrid else 0
    return dict(losses=_logged(trainer, "loss"), norms=_logged(trainer, "grad_norm"),
                final=_full(model) if hybrid else {k: v.detach().clone() for k, v in model.state_dict().items()},
                across=ledger_since(before, comm_counter.by_group()).get("0,2", {}), shard_bytes=shard_bytes)


def test_trainer_accumulating_on_a_hybrid_layout_equals_the_ddp_trainer(tmp_path) -> None:
    parts = run(4, _accumulating, str(tmp_path / "parts"), True, timeout=180)[0]
    ddp = run(4, _accumulating, str(tmp_path / "ddp"), False, timeout=180)[0]
    assert len(parts["losses"]) == STEPS
    assert parts["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
    assert parts["norms"] == pytest.approx(ddp["norms"], rel=1e-5)
    for k, v in parts["final"].items():
        torch.testing.assert_close(v, ddp["final"][k], rtol=1e-4, atol=1e-5)
    # across replicas: each fp32 grad shard once per step (2 replicas: all-reduce bytes = its size)
    assert parts["across"]["all_reduce_bytes"] == STEPS * parts["shard_bytes"]


def _accelerate_accumulating(step_mode: bool) -> dict:
    """accelerate's ``accumulate`` over 4 micro-batches per step, 2 steps, on a 2 x 2 hybrid layout."""
    import os

    from accelerate.state import AcceleratorState, GradientState
    from torch.distributed.device_mesh import init_device_mesh

    from parts.comm import comm_counter
    from parts.comm.counter import ledger_since
    from parts.integrations.accelerate import Accelerator, prepare
    from parts.partition import full_state_dict, meta, partitioned, set_replica_sync
    AcceleratorState._reset_state()  # accelerate's process-wide state: these workers outlive a test
    GradientState._reset_state()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # accelerate warns without it; workers run one thread
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    torch.manual_seed(0)
    with partitioned(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))):
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    model, optimizer = prepare(accelerator, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    if step_mode:
        set_replica_sync(model, "step")
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    before = comm_counter.by_group()
    for _ in range(STEPS * ACCUMULATION):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.randn(2, 8, generator=g)).square().mean())
            optimizer.step()
            optimizer.zero_grad()
    return dict(final=full_state_dict(model, rank0_only=False),
                across=ledger_since(before, comm_counter.by_group()).get("0,2", {}).get("all_reduce_bytes"),
                shard_bytes=sum(4 * meta(p).layout.shard_numel for p in model.parameters()))


def test_accelerate_accumulate_means_once_per_step_bitwise_as_the_step_mode() -> None:
    told = run(4, _accelerate_accumulating, False)[0]
    step = run(4, _accelerate_accumulating, True)[0]
    assert told["across"] == step["across"] == STEPS * told["shard_bytes"]
    assert all(torch.equal(v, step["final"][k]) for k, v in told["final"].items())
