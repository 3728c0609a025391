"""Hybrid layouts (2 x 2) with the optimizer state on disk and with shards (and their grads) on
disk, stepped after backward or during it: the losses, ``model.state_dict()`` and the grad norm
of the in-memory hybrid run, bitwise, on every rank."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from harness import run

STEPS, LR = 3, 0.05
KNOBS = dict(prefetch_bucket_size=2000, max_live_parameters=4000, persistence_threshold=0, max_reuse_distance=0)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 4))


def _mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))


def _groups() -> dict:
    """The 2 x 2 layout as ``partitioned``'s two explicit groups: shards on {0, 1} and {2, 3}."""
    import torch.distributed as dist
    rank = dist.get_rank()
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return {"group": rows[rank // 2], "replicate_group": columns[rank % 2]}


def _micro_batches(step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of ``step``: step 1 accumulates two of 2 rows, the others one of 4."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
    return [(x[:2], y[:2]), (x[2:], y[2:])] if step == 1 else [(x, y)]


def train(tmp: str, mode: str, clip: Optional[float], sync: str = "step") -> tuple[list, list, dict]:
    """3 steps of AdamW over a hybrid 2 x 2 model, ``mode``: "memory", "optim" (its state on disk:
    ``OffloadedOptimizer``), "disk" (shards and grads on disk too) or "in_backward" (and stepped
    during the last backward, its grad norm read after); clipped at ``clip`` (None: no norm read,
    so the step itself averages across replicas); the cross-replica mean at the step or at the end
    of each backward (``sync``). The losses, the grad norm of every step, ``model.state_dict()``."""
    import torch.distributed as dist
    from parts.offload import DiskStore, OffloadedOptimizer
    from parts.partition import (attach, clip_grad_norm_, gathered, grad_norm, partitioned, set_replica_sync,
                                 shards)
    rank = dist.get_rank()
    torch.manual_seed(7 + rank)  # every rank seeds apart: all start from rank 0's values
    # a budget whose reduce share (7.5 KiB) holds less than the 8.6 KiB of grads: the mean in buckets
    store = DiskStore(f"{tmp}/{mode}-{sync}-{rank}", threads=1, memory_budget=1 << 18, max_inflight_bytes=1 << 16) \
        if mode != "memory" else None
    with partitioned(**_groups(), remote_device=store if mode in ("disk", "in_backward") else None):
        model = _model()
    set_replica_sync(attach(model, **KNOBS), sync)
    opt = torch.optim.AdamW(shards(model), lr=LR)
    if store is not None:
        opt = OffloadedOptimizer(opt, store, chunk_bytes=8_000)
    losses, norms = [], []
    for step in range(STEPS):
        micro = _micro_batches(step, rank)
        for k, (x, y) in enumerate(micro):
            loss = nn.functional.mse_loss(model(x), y) / len(micro)
            last = mode == "in_backward" and k == len(micro) - 1
            with opt.step_in_backward() if last else contextlib.nullcontext():
                loss.backward()
            losses.append(loss.detach().clone())
        if mode == "in_backward":
            norms.append(grad_norm(model))
        elif clip is not None:
            norms.append(clip_grad_norm_(model, clip))
        opt.step()
        opt.zero_grad()
    with gathered(list(model.parameters())):  # fetched per module in training: gathered to read
        state = {k: v.clone() for k, v in model.state_dict().items()}
    if store is not None:
        opt.settle()
        store.close()
    return losses, norms, state


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_hybrid_offloaded_runs_equal_the_in_memory_hybrid_run_bitwise(tmp_path):
    clipped = run(4, train, str(tmp_path), "memory", 0.05)
    unclipped = run(4, train, str(tmp_path), "memory", 1e9)
    eager = run(4, train, str(tmp_path), "memory", None, "backward")  # mean(a) + b, then mean: other ulps
    assert clipped[0][2].keys() == unclipped[0][2].keys()
    assert not _same(clipped[0][2].values(), unclipped[0][2].values())  # the clip scaled the grads
    for mode, clip, sync, reference in (("optim", 0.05, "step", clipped), ("disk", 0.05, "step", clipped),
                                        ("disk", None, "step", unclipped), ("disk", None, "backward", eager),
                                        ("in_backward", None, "step", unclipped)):
        out = run(4, train, str(tmp_path), mode, clip, sync)
        for rank, (losses, norms, state) in enumerate(out):
            ref_losses, ref_norms, ref_state = reference[rank]
            assert _same(losses, ref_losses), (mode, clip, sync, rank)
            if norms:  # every rank the same norm, the in-memory run's
                assert _same(norms, ref_norms) and _same(norms, out[0][1]), (mode, rank, norms, ref_norms)
            assert state.keys() == ref_state.keys() and _same(state.values(), ref_state.values()), (mode, rank)


def train_bf16(tmp: str, on_disk: bool) -> tuple[list, dict]:
    """``BF16Optimizer`` (clipping) over bf16 shards of a hybrid 2 x 2 model, its fp32 masters and
    AdamW state in memory or (``on_disk``) in the store with the shards: its norms, the full state."""
    import torch.distributed as dist
    from parts.offload import DiskStore, OffloadedOptimizer
    from parts.optim import BF16Optimizer
    from parts.partition import attach, full_state_dict, partitioned
    rank, mesh = dist.get_rank(), _mesh()
    torch.manual_seed(7 + rank)
    store = DiskStore(f"{tmp}/bf16-{on_disk}-{rank}", block_bytes=4096, max_inflight_bytes=1 << 16)
    with partitioned(mesh=mesh, dtype=torch.bfloat16, remote_device=store if on_disk else None):
        model = _model()
    attach(model, **KNOBS)
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    opt = BF16Optimizer(OffloadedOptimizer(inner, store, chunk_bytes=6000) if on_disk else inner,
                        group=mesh.get_group("shard"), clip_grad=0.05)
    norms = []
    for step in range(STEPS):
        micro = _micro_batches(step, rank)
        for x, y in micro:
            (nn.functional.mse_loss(model(x.bfloat16()).float(), y) / len(micro)).backward()
        opt.step()
        opt.zero_grad()
        norms.append(opt.last_grad_norm)
    state = full_state_dict(model, rank0_only=False)
    store.close()
    return norms, state


def test_bf16_masters_on_disk_under_a_hybrid_layout_equal_memory_bitwise(tmp_path):
    memory = run(4, train_bf16, str(tmp_path), False)
    disk = run(4, train_bf16, str(tmp_path), True)
    assert memory[0][0][0] > 0.05  # clipped
    for (norms, state), (ref_norms, ref_state) in zip(disk, memory):
        assert norms == ref_norms == memory[0][0]  # every rank the same norm
        assert state.keys() == ref_state.keys() and all(torch.equal(state[k], ref_state[k]) for k in state)
