"""``Fabric(strategy="parts")`` runs a user's loop as ``Fabric(strategy="ddp")`` does, and saves and loads sharded.

The same loop (lightning_common.py's tiny GPT and rows) under both strategies at world 2:
``fabric.init_module()``, ``fabric.setup``, ``fabric.no_backward_sync`` over 2 micro-batches,
``fabric.backward``, ``fabric.clip_gradients``. DDP sums the micro-batches on each rank and then
across ranks, parts across ranks per micro-batch and then over micro-batches, and the clipping
norm sums in another order than torch's: 1e-6.
``fabric.save`` writes a sharded folder; ``fabric.load`` into a fresh model and optimizer goes
on bitwise, and at world 3 as the world-2 run does (the same rows per step; 5e-5).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

from harness import run  # noqa: E402
from lightning_common import CONFIG, GPT, lightning_run, loader  # noqa: E402

ACCUMULATE = 2


def _fabric(strategy: str) -> object:
    import torch.distributed as dist
    from lightning.fabric import Fabric

    import parts.integrations.lightning  # noqa: F401  registers "parts"
    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()
    return fabric


def _setup(fabric: object) -> tuple:
    """A GPT built under ``fabric.init_module()``, AdamW over its parameters, both set up."""
    fabric.seed_everything(0, verbose=False)
    with fabric.init_module():
        model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    return model, optimizer, fabric.setup_dataloaders(loader())


def _steps(fabric: object, model: object, optimizer: object, batches: list, clip: dict) -> list:
    """Optimizer steps over ``batches``, ACCUMULATE micro-batches each; the micro-batch losses."""
    losses = []
    for i, (x,) in enumerate(batches):
        accumulating = i % ACCUMULATE != ACCUMULATE - 1
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = model(x[:, :-1].contiguous(), x[:, 1:].contiguous())
            fabric.backward(loss / ACCUMULATE)
        losses.append(loss.item())
        if not accumulating:
            fabric.clip_gradients(model, optimizer, **clip)
            optimizer.step()
            optimizer.zero_grad()
    return losses


def _loop(strategy: str, clip: dict) -> dict:
    from parts.partition import is_partitioned
    with lightning_run():
        fabric = _fabric(strategy)
        model, optimizer, batches = _setup(fabric)
        losses = _steps(fabric, model, optimizer, list(batches)[:8], clip)
        return dict(losses=losses, sharded=all(is_partitioned(p) for p in model.parameters()),
                    wrapped=type(model._forward_module).__name__)


@pytest.mark.parametrize("clip", [dict(max_norm=0.1), dict(clip_val=1e-3)], ids=["norm", "value"])
def test_the_fabric_loop_on_parts_equals_the_loop_on_ddp(clip: dict) -> None:
    ddp = run(2, _loop, "ddp", clip, timeout=300)
    parts = run(2, _loop, "parts", clip, timeout=300)
    for got, ref in zip(parts, ddp):
        assert got["sharded"] and got["wrapped"] == "GPT" and ref["wrapped"] == "DistributedDataParallel"
        assert len(got["losses"]) == 8
        assert got["losses"] == pytest.approx(ref["losses"], rel=0, abs=1e-6)


def _save(root: str) -> dict:
    """4 steps, ``fabric.save``, 4 more; a fresh model and optimizer ``fabric.load`` it and take the 4 again."""
    from parts.partition import full_state_dict
    clip = dict(max_norm=0.1)
    with lightning_run():
        fabric = _fabric("parts")
        model, optimizer, batches = _setup(fabric)
        batches = list(batches)
        _steps(fabric, model, optimizer, batches[:8], clip)
        path = os.path.join(root, "step4")
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 4})
        weights = full_state_dict(model)
        went_on = _steps(fabric, model, optimizer, batches[8:16], clip)
        fresh, fresh_optimizer, _ = _setup(fabric)
        state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
        rest = fabric.load(path, state)
        loaded = _steps(fabric, fresh, fresh_optimizer, batches[8:16], clip)
    return dict(went_on=went_on, loaded=loaded, step=state["step"], rest=rest, weights=weights, path=path)


def _load_at_world3(path: str) -> dict:
    from parts.partition import full_state_dict
    with lightning_run():
        fabric = _fabric("parts")
        model, optimizer, batches = _setup(fabric)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(path, state)
        weights = full_state_dict(model)
        went_on = _steps(fabric, model, optimizer, list(batches)[8:16], dict(max_norm=0.1))
    return dict(step=state["step"], weights=weights, went_on=went_on)


def _mean(ranks: list, key: str) -> list:
    return [sum(step) / len(step) for step in zip(*(r[key] for r in ranks))]


def test_fabric_save_and_load_round_trip_sharded_at_world_2_and_3(tmp_path) -> None:
    saved = run(2, _save, str(tmp_path), timeout=300)
    for got in saved:
        assert got["step"] == 4 and got["rest"] == {}
        assert got["loaded"] == got["went_on"]  # weights and AdamW state came back bitwise
    assert sorted(p.name for p in (tmp_path / "step4").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    at3 = run(3, _load_at_world3, saved[0]["path"], timeout=300)
    assert at3[0]["step"] == 4
    for key, value in saved[0]["weights"].items():
        assert torch.equal(at3[0]["weights"][key], value), key
    # the same rows per step at world 2 and 3: the mean loss over ranks goes on as at world 2
    assert _mean(at3, "went_on") == pytest.approx(_mean(saved, "went_on"), rel=5e-5)


def _ddp_refused() -> str:
    from parts.partition import attach, partitioned
    with lightning_run():
        fabric = _fabric("ddp")
        with partitioned():
            model = GPT(CONFIG)
        attach(model)
        try:
            fabric.setup(model)
        except RuntimeError as err:
            return str(err)
    return "set up"


def test_fabric_strategy_ddp_with_a_parts_model_is_refused_naming_the_parts_strategy() -> None:
    for message in run(2, _ddp_refused, timeout=120):
        assert message.startswith("parts models need no DDP wrap") and 'strategy="parts"' in message
