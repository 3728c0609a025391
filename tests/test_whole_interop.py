"""The whole-tensor path with what surrounds a step: global-norm clipping, skipped non-finite
steps, MixedPrecision, wrappers (refused, naming the way out)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from harness import RankFailure, run
from test_whole_optim import Shapes

STEPS, NAN_STEP, CLIP = 8, 3, 0.05


def _batch(step: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(12, 5, generator=torch.Generator().manual_seed(step), dtype=dtype)
    if step == NAN_STEP:
        x[-1, 0] = float("nan")  # the last rank's slice: only that rank sees it
    return x


def _train(model, params, step_fn, world, rank, dtype):
    opt = torch.optim.Adafactor(params, lr=1e-2)
    for step in range(STEPS):
        x = _batch(step, dtype)
        model(x if rank is None else x.chunk(world)[rank]).backward()
        norm = step_fn(model)
        if torch.isfinite(norm):  # a non-finite norm: skip the step, drop the grads
            opt.step()
        opt.zero_grad()
    return opt


def clip_body(mixed: bool):
    from parts.partition import MixedPrecision, attach, clip_grad_norm_, full_state_dict, partition_module, shards
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    dtype = torch.float32 if mixed else torch.float64
    reference = Shapes().to(dtype)
    model = partition_module(copy.deepcopy(reference))
    attach(model, **({"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)} if mixed else {}))
    _train(reference, reference.parameters(),
           lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP), world, None, dtype)
    _train(model, shards(model), lambda m: clip_grad_norm_(m, CLIP), world, rank, dtype)
    got = full_state_dict(model, rank0_only=False)
    return {k: float((got[k] - v).norm() / v.norm()) for k, v in reference.state_dict().items()}


def test_clipping_by_the_global_norm_and_skipped_steps_are_exact() -> None:
    for errors in run(3, clip_body, False, timeout=120):
        assert max(errors.values()) < 1e-12, errors  # float64 throughout, the global norm too


def test_mixed_precision_stays_within_bf16_noise_of_fp32() -> None:
    # bf16 compute on each rank's rows against fp32 in one process: the flat (wrong) Adafactor is 4-7e-2 off
    for errors in run(2, clip_body, True, timeout=120):
        assert max(errors.values()) < 1e-2, errors


def wrapped_body(kind: str, scratch: str):
    from parts.partition import partition_module, shards
    torch.manual_seed(0)
    model = partition_module(Shapes())
    if kind == "bf16":
        from parts.optim import BF16Optimizer
        BF16Optimizer(torch.optim.Adafactor(shards(model)), allow_fp32=True)
    else:
        from parts.offload import DiskStore, OffloadedOptimizer
        OffloadedOptimizer(torch.optim.Adafactor(shards(model)), DiskStore(f"{scratch}/{dist.get_rank()}"))


@pytest.mark.parametrize("kind", ["bf16", "offload"])
def test_wrapping_a_shape_aware_optimizer_is_refused_naming_the_way_out(kind: str, tmp_path) -> None:
    with pytest.raises(RankFailure, match="Adafactor, which takes the whole path.*Step Adafactor.*unwrapped"):
        run(2, wrapped_body, kind, str(tmp_path))
