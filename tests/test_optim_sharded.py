"""BF16Optimizer on params that parts.partition already shards, mixed with replicated ones."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run

from parts.optim import BF16Optimizer

partition = pytest.importorskip("parts.partition")


def batch(step: int, rank: int):
    """Rank- and step-dependent data."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 7, generator=gen).to(torch.bfloat16), torch.randn(4, 5, generator=gen)


def reference(model: torch.nn.Module, world: int, steps: int, clip: float):
    """Plain mixed precision over `world` batches per step; returns losses, params, first norm."""
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params]
    inner = torch.optim.AdamW(masters, lr=1e-2)
    norms = []
    for step in range(steps):
        grads = [torch.zeros_like(m) for m in masters]
        for r in range(world):
            loss = F.mse_loss(model(batch(step, r)[0]).float(), batch(step, r)[1])
            loss.backward()
            for g, p in zip(grads, params):
                g.add_(p.grad)
                p.grad = None
        for g, m in zip(grads, masters):
            m.grad = g.div_(world)
        norms.append(float(torch.nn.utils.clip_grad_norm_(masters, clip or float("inf"))))
        inner.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return [p.detach().clone() for p in params], norms


def mixed_body(steps: int, clip: float):
    """Layer 0 sharded by parts.partition, layer 2 replicated; the optimizer steps both."""
    from parts.partition import gather, is_partitioned, meta, partition_module, reduce_scatter_grads
    from parts.partition import release
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.GELU(), torch.nn.Linear(13, 5))
    model = model.to(torch.bfloat16)
    ref_params, ref_norms = reference(copy.deepcopy(model), world, steps, clip)
    partition_module(model[0])
    sharded = list(model[0].parameters())
    assert all(is_partitioned(p) for p in sharded)
    opt = BF16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), clip_grad=clip)
    norms = []
    for step in range(steps):
        gather(sharded)
        x, y = batch(step, rank)
        F.mse_loss(model(x).float(), y).backward()
        reduce_scatter_grads(sharded)
        release(sharded)
        opt.step()
        opt.zero_grad()
        norms.append(opt.last_grad_norm)
        assert all(meta(p).grad_shard is None for p in sharded)
    full = [opt.full_fp32_param(p).to(torch.bfloat16) for p in model.parameters()]
    gather(sharded)
    params = [p.detach().clone() for p in model.parameters()]
    release(sharded)
    return params, full, ref_params, norms, ref_norms


@pytest.mark.parametrize("world", [2, 3])
def test_mixed_sharded_and_replicated_matches_reference(world: int) -> None:
    """Sharded shards are stepped in place (the gathered params equal the master cast), the norm
    counts every element once, and the trajectory equals the reference bitwise (fp32 sums of
    2-3 bf16 grads are exact here, so the reduction order does not matter)."""
    for params, full, ref_params, norms, ref_norms in run(world, mixed_body, 6, 0.0):
        for p, f in zip(params, full):
            assert torch.equal(p, f)
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        for p, r in zip(params, ref_params):
            assert torch.equal(p, r)


def test_mixed_clipping_norm_counts_shards_once() -> None:
    """With clipping the global norm equals torch's over the full reference grads (fp32, rel 1e-5);
    the clip coefficient then differs in the last bits, so bf16 params may differ by one ulp."""
    for params, full, ref_params, norms, ref_norms in run(2, mixed_body, 3, 0.05):
        assert norms[0] == pytest.approx(ref_norms[0], rel=1e-5)
        for p, r in zip(params, ref_params):
            torch.testing.assert_close(p.float(), r.float(), rtol=8e-3, atol=1e-6)
