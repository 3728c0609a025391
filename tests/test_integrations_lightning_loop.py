"""What ``Trainer(strategy="parts")`` maps onto parts: precision, clipping, accumulation, evaluation, construction.

Each run is compared with ``Trainer(strategy="ddp")`` on the same seeds and rows (lightning_common.py).
Under accumulation DDP sums micro-batches on each rank and then across ranks, parts across
ranks per micro-batch and then over micro-batches, and the clipping norm sums in another order
than torch's: fp32 losses agree to 1e-6. Mixed precision: parts gathers bf16 weights where
DDP's autocast casts fp32 ones per op, within the project's 1e-2 relative loss of
``MixedPrecision`` against a reference.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

from harness import run  # noqa: E402
from lightning_common import CONFIG, fit, lightning_run, loader, module_class, trainer  # noqa: E402


def _parts(**knobs: object) -> object:
    from parts.integrations.lightning import PartsStrategy
    return PartsStrategy(**knobs)


def _both(root: str, steps: int, *, sgd: bool = False, **kwargs: object) -> dict:
    """The losses of DDP and of parts (and, with ``clip``, of DDP unclipped) over ``steps`` steps."""
    with lightning_run():
        import parts.integrations.lightning  # noqa: F401
        out = {}
        for name in ("ddp", "parts"):
            module = module_class()(lr=0.5 if sgd else 1e-2, sgd=sgd)
            out[name] = fit(name, os.path.join(root, name), steps, module=module, **kwargs).losses
        plain = {k: v for k, v in kwargs.items() if not k.startswith("gradient_clip")}
        out["unclipped"] = fit("ddp", os.path.join(root, "plain"), steps, module=module_class()(
            lr=0.5 if sgd else 1e-2, sgd=sgd), **plain).losses
    return out


@pytest.mark.parametrize("algorithm,clip", [("norm", 0.05), ("value", 1e-3)])
def test_clipping_with_accumulation_clips_as_ddp_does(tmp_path, algorithm: str, clip: float) -> None:
    for got in run(2, _both, str(tmp_path), 4, sgd=True, gradient_clip_val=clip,
                   gradient_clip_algorithm=algorithm, accumulate_grad_batches=2, timeout=300):
        assert len(got["parts"]) == 8  # 4 steps of 2 micro-batches
        assert got["parts"] == pytest.approx(got["ddp"], rel=0, abs=1e-6)
        assert abs(got["ddp"][-1] - got["unclipped"][-1]) > 1e-3  # the clip acts


def test_bf16_mixed_with_clipping_and_accumulation_stays_near_ddp_under_the_same_precision(tmp_path) -> None:
    for got in run(2, _both, str(tmp_path), 5, precision="bf16-mixed", gradient_clip_val=1.0,
                   accumulate_grad_batches=2, timeout=300):
        assert len(got["parts"]) == 10
        assert got["parts"] == pytest.approx(got["ddp"], rel=1e-2)
        assert got["parts"][2:] != got["ddp"][2:]  # bf16 weights, not DDP's fp32 ones under autocast


def _bf16_true(root: str) -> dict:
    with lightning_run():
        import parts.integrations.lightning  # noqa: F401
        from parts.partition import meta
        from parts.partition.coordinator import attached_to
        losses = {}
        for name in ("ddp", "parts", "fp32"):
            module = fit("parts" if name == "fp32" else name, os.path.join(root, name), 4,
                         precision="32-true" if name == "fp32" else "bf16-true")
            losses[name] = module.losses
            if name == "parts":
                policy = attached_to(module).mixed_precision
                shard_dtypes = {meta(p).shard.dtype for p in module.parameters()}
    return dict(losses=losses, shard_dtypes=shard_dtypes, compute=policy.param_dtype)


def test_bf16_true_computes_in_bf16_from_fp32_shards_near_ddp_s_bf16_weights(tmp_path) -> None:
    for got in run(2, _bf16_true, str(tmp_path), timeout=300):
        assert got["shard_dtypes"] == {torch.float32} and got["compute"] == torch.bfloat16
        assert got["losses"]["parts"] == pytest.approx(got["losses"]["ddp"], rel=1e-2)
        assert got["losses"]["parts"][1:] != got["losses"]["fp32"][1:]  # not fp32 compute


def _evaluate(root: str) -> dict:
    """Fit with validation, then validate and predict (greedy generation) again, under DDP and parts."""
    with lightning_run():
        import lightning.pytorch as pl

        import parts.integrations.lightning  # noqa: F401
        out = {}
        for name in ("ddp", "parts"):
            pl.seed_everything(0, verbose=False)
            module = module_class()()
            run_ = trainer(name, os.path.join(root, name), max_steps=3, val_check_interval=3,
                           limit_val_batches=2)
            run_.fit(module, loader(), loader())
            run_.validate(module, loader(), verbose=False)
            predicted = run_.predict(module, torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(loader().dataset.tensors[0][:4]), batch_size=2))
            out[name] = dict(val=module.val_losses, predicted=torch.cat(predicted))
    return out


def test_validation_and_predict_with_generation_give_ddp_s_results(tmp_path) -> None:
    for got in run(2, _evaluate, str(tmp_path), timeout=300):
        assert len(got["parts"]["val"]) == 4  # in fit, and in validate
        assert got["parts"]["val"] == got["ddp"]["val"]
        assert torch.equal(got["parts"]["predicted"], got["ddp"]["predicted"])
        assert got["parts"]["predicted"].shape == (2, 8)  # this rank's 2 rows, 4 prompt + 4 new tokens


def _construction(root: str) -> dict:
    """Where the model is sharded: in configure_model, under trainer.init_module(), or on setup."""
    from gpt_model import GPT
    from parts.partition import is_partitioned
    with lightning_run():
        import parts.integrations.lightning  # noqa: F401
        seen = {}
        TinyLM = module_class()

        class Watching(TinyLM):
            def configure_model(self) -> None:
                super().configure_model()
                seen["configure_model"] = all(is_partitioned(p) for p in self.parameters())

        ddp = fit("ddp", os.path.join(root, "ddp"), 3).losses
        configured = fit("parts", os.path.join(root, "a"), 3, module=Watching()).losses
        run_ = trainer(_parts(persistence_threshold=0), os.path.join(root, "b"), max_steps=3)
        import lightning.pytorch as pl
        pl.seed_everything(0, verbose=False)
        with run_.init_module():
            module = TinyLM(GPT(CONFIG))
        seen["init_module"] = all(is_partitioned(p) for p in module.parameters())
        run_.fit(module, loader())
        pl.seed_everything(0, verbose=False)
        plain = TinyLM(GPT(CONFIG))  # built before fit, not sharded: sharded on setup
        seen["before_fit"] = any(is_partitioned(p) for p in plain.parameters())
        on_setup = fit("parts", os.path.join(root, "c"), 3, module=plain).losses
    return dict(seen=seen, ddp=ddp, configured=configured, init_module=module.losses, on_setup=on_setup,
                released=sum(1 for p in module.parameters() if p.data.numel() == 0))


def test_the_model_is_sharded_at_construction_or_on_setup_and_trains_as_ddp(tmp_path) -> None:
    for got in run(2, _construction, str(tmp_path), timeout=300):
        assert got["seen"] == dict(configure_model=True, init_module=True, before_fit=False)
        assert got["configured"] == got["init_module"] == got["on_setup"] == got["ddp"]
        assert got["released"] > 0  # persistence_threshold=0 reached attach: parameters released between steps


def _ddp_refused(root: str) -> str:
    """``Trainer(strategy="ddp")`` given a LightningModule holding a parts model: DDP wraps the parent."""
    from gpt_model import GPT
    from parts.partition import attach, partitioned
    with lightning_run():
        with partitioned():
            model = GPT(CONFIG)
        attach(model)
        try:
            fit("ddp", root, 2, module=module_class()(model))
        except RuntimeError as err:
            return str(err)
    return "trained"


def test_trainer_strategy_ddp_with_a_parts_model_is_refused_naming_the_parts_strategy(tmp_path) -> None:
    for message in run(2, _ddp_refused, str(tmp_path), timeout=120):
        assert message.startswith("parts models need no DDP wrap: DistributedDataParallel(TinyLM) would wrap")
        assert 'strategy="parts"' in message


def _refused(root: str) -> list:
    messages = []
    with lightning_run():
        from parts.integrations.lightning import PartsStrategy
        for precision in ("16-true", "64-true"):
            try:
                trainer("parts", root, precision=precision)
            except ValueError as err:
                messages.append(str(err))
        try:
            PartsStrategy(persistence_treshold=0)
        except TypeError as err:
            messages.append(str(err))
    return messages


def test_precisions_and_knobs_parts_cannot_honour_raise_when_the_trainer_is_made(tmp_path) -> None:
    sixteen, sixty_four, knob = run(2, _refused, str(tmp_path), timeout=120)[0]
    assert "precision='16-true'" in sixteen and "'bf16-mixed'" in sixteen
    assert "precision='64-true'" in sixty_four
    assert "persistence_treshold" in knob and "persistence_threshold" in knob


def _hybrid(root: str) -> dict:
    """4 steps of 2 micro-batches at world 4: DDP, and parts on a 2 x 2 mesh (2 replicas of 2 shards)."""
    from torch.distributed.device_mesh import init_device_mesh

    from parts.comm import comm_counter
    from parts.comm.counter import ledger_since
    from parts.partition import meta
    with lightning_run():
        ddp = fit("ddp", os.path.join(root, "ddp"), 4, accumulate_grad_batches=2).losses
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        before = comm_counter.by_group()
        module = fit(_parts(mesh=mesh), os.path.join(root, "parts"), 4, accumulate_grad_batches=2)
        across = ledger_since(before, comm_counter.by_group()).get("0,2", {})
    shard_bytes = sum(4 * meta(p).layout.shard_numel for p in module.parameters())
    return dict(ddp=ddp, parts=module.losses, across=across, shard_bytes=shard_bytes)


@pytest.mark.slow
def test_accumulation_on_a_hybrid_layout_averages_across_replicas_once_per_step(tmp_path) -> None:
    got = run(4, _hybrid, str(tmp_path), timeout=300)
    for rank in got:
        assert len(rank["parts"]) == 8
        assert rank["parts"] == pytest.approx(rank["ddp"], rel=1e-5)
    # each fp32 grad shard crosses the 2 replicas once per optimizer step, not once per micro-batch
    assert got[0]["across"]["all_reduce_bytes"] == 4 * got[0]["shard_bytes"]
