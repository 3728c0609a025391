"""The placement audit stage of ``gpu_check.py``: tests/placement_audit.py on device tensors."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from gpu_checks import Context, adamw, batches, sharded, train


def _audit_scenarios(ctx: Context) -> dict[str, Callable[[], None]]:
    """Steps on the device that must keep every collective's tensors on the communication device."""
    from parts.offload import DiskStore, OffloadedOptimizer
    from parts.optim import BF16Optimizer
    from parts.partition import MixedPrecision, attach, clip_grad_norm_, shards
    config = ctx.config()
    data = batches(ctx, config, 2, 2, seed=10)

    def step(clip: float = 0.0, bf16_optimizer: bool = False, **knobs: Any) -> Callable[[], None]:
        def body() -> None:
            model = sharded(ctx, config)
            attach(model, **knobs)
            opt = (BF16Optimizer(adamw(model.parameters()), clip_grad=1.0, allow_fp32=True) if bf16_optimizer
                   else adamw(shards(model)))

            def clipped(loss: torch.Tensor) -> None:
                loss.backward()
                clip_grad_norm_(model, clip)
            train(model, opt, data, backward=clipped if clip else None)
        return body

    def offload() -> None:
        store = DiskStore(tempfile.mkdtemp(dir=ctx.scratch))
        try:
            model = sharded(ctx, config, remote=store)
            attach(model)
            opt = OffloadedOptimizer(adamw(shards(model)), store)

            def in_backward(loss: torch.Tensor) -> None:
                with opt.step_in_backward():
                    loss.backward()
            train(model, opt, data, backward=in_backward)
        finally:
            store.close()
    return {"mixed_precision": step(mixed_precision=MixedPrecision(), persistence_threshold=0),
            "flat_persistent": step(), "clip": step(clip=1.0), "bf16_optimizer": step(bf16_optimizer=True),
            "debug_mode": step(debug=True), "offload_step_in_backward": offload}


def stage_audit(ctx: Context) -> None:
    """The placement audit (tests/placement_audit.py) on the device, rank 0 of a fake world of 2: every
    collective's tensors on the communication device. On the CPU it cannot flag anything (every tensor
    is on the CPU): the scenarios run, and tests/test_placement_audit.py audits with a declared device."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    try:
        from placement_audit import Audit, fake_group, run_scenario
    except ImportError:
        ctx.record("audit", "SKIP", "not available: this checkout has no tests/placement_audit.py")
        return
    for name, body in _audit_scenarios(ctx).items():
        with ctx.guard(f"audit.{name}"), fake_group(2):
            out = run_scenario(Audit(ctx.device), body, "cpu")
            found = "; ".join(f"{entry} at {site} on {devices} x{n}"
                              for (entry, site, devices), n in out["violations"].items())
            detail = (f"{out['collectives']} collectives, off the device: {found or 'none'}"
                      + (f"; raised {out['error']}" if out["error"] else ""))
            ok = out["error"] is None and not found and out["collectives"] > 0
            if ctx.mode == "cuda" or not ok:
                ctx.expect(f"audit.{name}", ok, detail)
            else:
                ctx.record(f"audit.{name}", "INFO", detail + " (on the CPU nothing can be off the device)")
