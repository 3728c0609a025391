"""Compressed collectives with shards and grads on disk (``partitioned(remote_device=DiskStore)``,
``OffloadedOptimizer``): int8 weights and int8 grads with error feedback train bitwise as the
same compressed run in memory, stepping after backward or during it, with accumulation, fully
sharded and as a hybrid 2 x 2 layout whose cross-replica mean travels as codes."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from harness import run
from test_hybrid_offload import _groups, _micro_batches

STEPS, LR = 3, 0.05
KNOBS = dict(prefetch_bucket_size=2000, max_live_parameters=4000, persistence_threshold=0, max_reuse_distance=0)
POLICY = {"weights": "int8", "grads": "int8", "block": 32}


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 4))


def _layout(kind: str) -> dict:
    """``partitioned`` groups: all ranks ("flat") or shards on {0, 1} and {2, 3} ("hybrid")."""
    return {} if kind == "flat" else _groups()


def train(tmp: str, kind: str, mode: str, policy) -> tuple[list, dict, int]:
    """AdamW steps in ``mode``: "memory", "disk" (shards, grads and optimizer state in a
    ``DiskStore``) or "in_backward" (and stepped during each step's last backward). The losses,
    ``model.state_dict()`` and the error-feedback memory."""
    import torch.distributed as dist
    from parts.offload import DiskStore, OffloadedOptimizer
    from parts.partition import Compression, attach, gathered, partitioned, shards
    rank = dist.get_rank()
    store = DiskStore(f"{tmp}/{kind}-{mode}-{rank}", threads=1, block_bytes=4096, max_inflight_bytes=1 << 16) \
        if mode != "memory" else None
    torch.manual_seed(7)
    with partitioned(**_layout(kind), remote_device=store):
        model = _model()
    coordinator = attach(model, compression=Compression(**policy) if policy else None, **KNOBS)
    opt = torch.optim.AdamW(shards(model), lr=LR)
    if store is not None:
        opt = OffloadedOptimizer(opt, store, chunk_bytes=8_000)
    losses = []
    for step in range(STEPS):
        micro = _micro_batches(step, rank)
        for k, (x, y) in enumerate(micro):
            loss = nn.functional.mse_loss(model(x), y) / len(micro)
            last = mode == "in_backward" and k == len(micro) - 1
            with opt.step_in_backward() if last else contextlib.nullcontext():
                loss.backward()
            losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
    residual = coordinator.stats().residual_bytes
    with gathered(list(model.parameters())):
        state = {k: v.clone() for k, v in model.state_dict().items()}
    if store is not None:
        opt.settle()
        store.close()
    return losses, state, residual


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind, world, policy", [
    ("flat", 2, POLICY), ("hybrid", 4, dict(POLICY, on="replicas"))])
def test_compressed_training_with_shards_and_grads_on_disk_equals_it_in_memory_bitwise(tmp_path, kind, world,
                                                                                      policy):
    memory = run(world, train, str(tmp_path), kind, "memory", policy)
    plain = run(world, train, str(tmp_path), kind, "memory", None)
    assert not _same(memory[0][0], plain[0][0])  # the codes change the training: the test can fail
    for mode in ("disk", "in_backward"):
        for rank, (losses, state, residual) in enumerate(run(world, train, str(tmp_path), kind, mode, policy)):
            ref_losses, ref_state, ref_residual = memory[rank]
            assert _same(losses, ref_losses), (mode, rank)
            assert state.keys() == ref_state.keys() and _same(state.values(), ref_state.values()), (mode, rank)
            assert residual == ref_residual > 0
