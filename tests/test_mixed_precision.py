"""MixedPrecision: fp32 shards as the master, bf16 compute and wire, fp32 grads.

* unit: the policy's validation, what ``attach`` records, bf16 bytes on the wire (counted);
* exactness: the policy's grad shards are the fp32 sum of the bf16 full grads (reference
  computed by hand from the same bf16 weights), micro-batches accumulate in fp32;
* acceptance: a small GPT trained 30 steps at world 2 with the policy, with fp32, and with
  FSDP2 ``fully_shard`` + ``MixedPrecisionPolicy(bf16, fp32)``: the policy's relative final-loss
  gap to fp32 is at most FSDP2's, and two runs are bitwise equal.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

from harness import run
from parts.partition import MixedPrecision, attach, meta, partitioned, shards

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recipes"))

BF16 = torch.bfloat16


def test_policy_validates_and_normalises() -> None:
    assert MixedPrecision().param_dtype is BF16 and MixedPrecision().reduce_dtype is torch.float32
    assert MixedPrecision(keep_fp32=nn.LayerNorm).keep_fp32 == (nn.LayerNorm,)
    with pytest.raises(ValueError, match="param_dtype"):
        MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(TypeError, match="keep_fp32"):
        MixedPrecision(keep_fp32=("LayerNorm",))
    with pytest.raises(Exception):
        MixedPrecision().param_dtype = torch.float16  # frozen


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    with partitioned():
        model = nn.Sequential(nn.Linear(15, 33), nn.LayerNorm(33), nn.Linear(33, 7))
    return model


def _wire_body() -> dict:
    model = _tiny()
    coord = attach(model, mixed_precision=MixedPrecision(keep_fp32=(nn.LayerNorm,)),
                   persistence_threshold=0, overlap_comm=False)
    seen = {}
    hook = model[2].register_forward_pre_hook(lambda m, a: seen.update(dtype=m.weight.dtype, x=a[0].dtype))
    model(torch.randn(5, 15)).float().square().mean().backward()
    hook.remove()
    stats = coord.stats()
    ln = meta(model[1].weight)
    out = dict(stats=(stats.allgather_bytes, stats.reduce_scatter_bytes), seen=seen,
               compute=[meta(p).compute_dtype for p in model.parameters()],
               grads=[s.grad.dtype for s in shards(model)], ln_dtype=ln.dtype)
    coord.detach()
    out["after_detach"] = [meta(p).compute_dtype for p in model.parameters()]
    return out


def test_attach_records_dtypes_and_counts_bf16_bytes() -> None:
    out = run(2, _wire_body)[0]
    assert out["seen"] == {"dtype": BF16, "x": BF16}  # the LayerNorm's fp32 output is cast back
    assert out["compute"] == [BF16, BF16, None, None, BF16, BF16]
    assert out["grads"] == [torch.float32] * 6 and out["ln_dtype"] is torch.float32
    assert out["after_detach"] == [None] * 6
    # shard numels at world 2: 15*33=495 -> 248, 33 -> 17 (x4: Linear bias, LN weight/bias, ...)
    shard = {"w0": 248, "b0": 17, "lnw": 17, "lnb": 17, "w2": 116, "b2": 4}
    bf16 = 2 * (shard["w0"] + shard["b0"] + shard["w2"] + shard["b2"])
    fp32 = 4 * (shard["lnw"] + shard["lnb"])
    gathered_twice = 2 * (bf16 + fp32)  # forward, and again for backward (release after use)
    assert out["stats"][0] in (bf16 + fp32, gathered_twice)
    # grads summed in fp32; on gloo the bf16 grads travel as bf16 (exact), the LayerNorm's as fp32
    assert out["stats"][1] == bf16 + fp32


def _grads_body(micro: int) -> list:
    """Grad shards under the policy vs the fp32 sum of bf16 grads computed by hand."""
    model = _tiny()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    from parts.partition import full_state_dict
    full = full_state_dict(model, rank0_only=False)
    attach(model, mixed_precision=MixedPrecision(), overlap_comm=False)
    ref = nn.Sequential(nn.Linear(15, 33), nn.LayerNorm(33), nn.Linear(33, 7))
    ref.load_state_dict(full)
    ref.to(BF16)
    expect = [torch.zeros(p.numel()) for p in ref.parameters()]
    for k in range(micro):
        for r in range(world):
            x = torch.randn(4, 15, generator=torch.Generator().manual_seed(100 * k + r))
            if r == rank:
                model(x).float().square().mean().backward()
            ref.zero_grad()
            ref(x.to(BF16)).float().square().mean().backward()
            for e, p in zip(expect, ref.parameters()):
                e += p.grad.float().reshape(-1) / world
    ok = []
    for s, p, e in zip(shards(model), model.parameters(), expect):
        lo, hi = meta(p).layout.range(rank)
        ok.append(torch.allclose(s.grad[:hi - lo], e[lo:hi], rtol=1e-6, atol=1e-7))
    return ok


@pytest.mark.parametrize("micro", [1, 3])
def test_grad_shards_are_fp32_sums_of_bf16_grads(micro: int) -> None:
    for ok in run(2, _grads_body, micro):
        assert all(ok)


# The policy, and one-change experiments around it (fp32 has none).
_EXPERIMENTS = {"parts": MixedPrecision(), "parts_rounded_init": MixedPrecision(),
                "parts_ln_fp32": MixedPrecision(keep_fp32=(nn.LayerNorm,)),
                "parts_reduce_bf16": MixedPrecision(reduce_dtype=BF16)}


def _train_body(system: str, steps: int) -> list:
    """Final loss (mean over ranks) of a small GPT trained ``steps`` steps by ``system``."""
    import torch.distributed as dist
    from chardata import VOCAB_SIZE, batch, load_splits
    from gpt_model import GPT, GPTConfig
    torch.set_num_threads(1)
    config = GPTConfig(vocab_size=VOCAB_SIZE, block_size=32, n_layer=2, n_embd=64)
    torch.manual_seed(0)
    if system == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        model = GPT(config)
        policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        params = list(model.parameters())
    elif system == "bf16_optimizer":  # bf16 shards, fp32 masters rounded from them
        with partitioned(dtype=BF16):
            model = GPT(config)
        attach(model)
        params = list(model.parameters())
    elif system == "zero1_cast":  # replicated fp32 model; BF16Optimizer keeps fp32 masters, casts params
        model = GPT(config)
        params = list(model.parameters())
    else:
        with partitioned():
            model = GPT(config)
        attach(model, mixed_precision=_EXPERIMENTS.get(system))
        params = shards(model)
        if system == "parts_rounded_init":
            with torch.no_grad():
                for s in params:
                    s.copy_(s.to(BF16))
    optimizer = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    if system in ("bf16_optimizer", "zero1_cast"):
        from parts.optim import BF16Optimizer
        optimizer = BF16Optimizer(optimizer, param_dtype=BF16 if system == "zero1_cast" else None)
    tokens, _ = load_splits(None)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(steps):
        loss = model(*batch(tokens, 8, config.block_size, generator))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


@pytest.mark.slow
def test_policy_tracks_fp32_as_closely_as_fsdp2() -> None:
    steps = 30
    fp32 = run(2, _train_body, "fp32", steps, timeout=300)[0]
    parts, again = (run(2, _train_body, "parts", steps, timeout=300)[0] for _ in range(2))
    fsdp2 = run(2, _train_body, "fsdp2", steps, timeout=300)[0]
    assert parts == again  # bitwise reproducible run to run
    gap = abs(parts[-1] / fp32[-1] - 1)
    fsdp2_gap = abs(fsdp2[-1] / fp32[-1] - 1)
    assert fp32[-1] < fp32[0] - 0.5  # it learned something
    assert gap <= fsdp2_gap, (gap, fsdp2_gap, parts[-1], fsdp2[-1], fp32[-1])


def _optimizer_cast_body() -> list:
    """BF16Optimizer(param_dtype=bf16) on an fp32 model: fp32 masters, bf16 params, one exact step."""
    from parts.optim import BF16Optimizer
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(15, 33), nn.LayerNorm(33), nn.Linear(33, 7))
    init = [p.detach().clone() for p in model.parameters()]
    optimizer = BF16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), param_dtype=BF16)
    out = [all(p.dtype is BF16 and torch.equal(p, i.to(BF16)) for p, i in zip(model.parameters(), init))]
    out.append(all(torch.equal(optimizer.full_fp32_param(p), i) for p, i in zip(model.parameters(), init)))
    rank = torch.distributed.get_rank()
    x = torch.randn(6, 15, generator=torch.Generator().manual_seed(rank))
    model(x.to(BF16)).float().square().mean().backward()
    grads = [optimizer.full_grad(p) for p in model.parameters()]
    optimizer.step()
    ref = [i.clone().requires_grad_() for i in init]  # AdamW on the fp32 init with the same fp32 grads
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    torch.optim.AdamW(ref, lr=1e-2).step()
    out.append(all(torch.equal(optimizer.full_fp32_param(p), r.detach()) for p, r in zip(model.parameters(), ref)))
    out.append(all(torch.equal(p, r.detach().to(BF16)) for p, r in zip(model.parameters(), ref)))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_optimizer_masters_from_fp32_values(world: int) -> None:
    for masters_ok in run(world, _optimizer_cast_body):
        assert masters_ok == [True, True, True, True]


def _optimizer_cast_accumulates_body(micro: int) -> bool:
    """BF16Optimizer(param_dtype=bf16): ``micro`` backwards accumulate into fp32 grads, the mean
    over ranks of the fp32 sum of the bf16 grads (reference by hand on a bf16 copy)."""
    from parts.optim import BF16Optimizer
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(15, 33), nn.LayerNorm(33), nn.Linear(33, 7))
    ref = nn.Sequential(nn.Linear(15, 33), nn.LayerNorm(33), nn.Linear(33, 7))
    ref.load_state_dict(model.state_dict())
    ref.to(BF16)
    optimizer = BF16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), param_dtype=BF16)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    expect = [torch.zeros(p.shape) for p in ref.parameters()]
    for r in range(world):
        local = [torch.zeros(p.shape) for p in ref.parameters()]
        for k in range(micro):
            x = torch.randn(4, 15, generator=torch.Generator().manual_seed(100 * k + r)).to(BF16)
            if r == rank:
                model(x).float().square().mean().backward()
            ref.zero_grad()
            ref(x).float().square().mean().backward()
            for acc, p in zip(local, ref.parameters()):
                acc += p.grad.float()
        for e, acc in zip(expect, local):
            e += acc / world
    got = [optimizer.full_grad(p) for p in model.parameters()]
    return all(g.dtype is torch.float32 and torch.allclose(g, e, rtol=1e-6, atol=1e-8)
               for g, e in zip(got, expect))


def test_bf16_optimizer_cast_accumulates_grads_in_fp32() -> None:
    assert run(2, _optimizer_cast_accumulates_body, 3) == [True, True]


def _optimizer_cast_refuses_fp32_shards() -> str:
    from parts.optim import BF16Optimizer
    with partitioned():
        model = nn.Linear(4, 4)
    try:
        BF16Optimizer(torch.optim.AdamW(model.parameters()), param_dtype=BF16)
    except TypeError as error:
        return str(error)
    return ""


def test_bf16_optimizer_cast_points_sharded_params_to_the_policy() -> None:
    assert "MixedPrecision" in run(1, _optimizer_cast_refuses_fp32_shards)[0]
    with pytest.raises(ValueError, match="param_dtype"):
        from parts.optim import BF16Optimizer
        BF16Optimizer(torch.optim.AdamW(nn.Linear(2, 2).parameters()), param_dtype=torch.float32)
