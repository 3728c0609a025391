"""parts.checkpoint with partition_group sizes 1..4 through the harness.

Every rank builds the same model and inputs from the same seed (partitioning assumes the
activations are replicated across the group), so each rank's checkpointed grads must be
bitwise equal to its own grads without checkpointing. Activation sizes (55, 35, 3, 10
elements) are uneven over 2, 3 and 4 ranks, and 3 < 4 leaves a rank with padding only.
The replica check's checksum and rank comparison are property-tested at the end.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, settings, strategies as st

from harness import run
from parts.checkpoint import CheckpointPolicy, ContiguousBuffers, checkpoint, seed_model_parallel
from parts.checkpoint.replicas import checksum, differing_ranks, replica_error
from parts.partition import ShardLayout
from test_checkpoint import CASES, MLP, assert_all_equal, case_grads
from test_checkpoint_memory import live_bytes_between_forward_and_backward
from test_checkpoint import _one_thread  # noqa: F401 - the same autouse fixture here


def _policy(kind: str, group):
    if kind == "partition":
        return CheckpointPolicy(partition_group=group)
    return CheckpointPolicy(partition_group=group, cpu_offload=True, buffers=ContiguousBuffers(8),
                            synchronize=True, profile=True, check_replicated=True,
                            rng_tracker=seed_model_parallel(3, group))


def _all_cases(kind: str):
    group = dist.group.WORLD
    out = {}
    for name in CASES:
        out[name] = (case_grads(name, ckpt=False), case_grads(name, policy=_policy(kind, group)),
                     case_grads(name, policy=_policy(kind, group), use_grad_api=True))
    return out


@pytest.mark.parametrize("kind", ["partition", "combined"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_partitioned_grads_bitwise_equal(world, kind):
    results = run(world, _all_cases, kind, timeout=120)
    for rank, per_case in enumerate(results):
        for name, (ref, got, got_grad_api) in per_case.items():
            assert_all_equal(ref, got)
            assert_all_equal(ref, got_grad_api)
    # identical seeds: every rank computed the same grads
    for name in CASES:
        assert_all_equal(results[0][name][0], results[-1][name][1])


def _memory_partitioned():
    torch.manual_seed(0)
    blocks = nn.ModuleList(MLP(dim=32, hidden=128) for _ in range(12))
    x = torch.randn(4, 16, 32, requires_grad=True)
    policy = CheckpointPolicy(partition_group=dist.group.WORLD)
    part, after = live_bytes_between_forward_and_backward(blocks, x, policy, ckpt=True)
    return part, after, x.numel()


@pytest.fixture(scope="module")
def unpartitioned_bytes():
    """Live bytes of the same 12 blocks in this process: (no checkpoint, checkpoint)."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(MLP(dim=32, hidden=128) for _ in range(12))
    x = torch.randn(4, 16, 32, requires_grad=True)
    full, _ = live_bytes_between_forward_and_backward(blocks, x, None, ckpt=False)
    ckpt, _ = live_bytes_between_forward_and_backward(blocks, x, None, ckpt=True)
    return full, ckpt


@pytest.mark.parametrize("world", [2, 3, 4])
def test_memory_partitioned_keeps_input_shares(world, unpartitioned_bytes):
    full, ckpt = unpartitioned_bytes
    for part, after, numel in run(world, _memory_partitioned):
        share_bytes = ShardLayout(numel, world).shard_numel * 4
        assert 12 * share_bytes <= part <= 12 * share_bytes + 64  # + the 4-byte loss
        assert ckpt / part >= world * 0.99  # 2048 floats over 3 ranks pads 2 elements
        assert part / full < 0.125 / world
        assert after <= 64


def _replica_check(bad_rank):
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(5, 11)
    mask = torch.ones(5, dtype=torch.bool)
    if dist.get_rank() == bad_rank:
        x[4, 10] += 1.0
    policy = CheckpointPolicy(partition_group=dist.group.WORLD, check_replicated=True)
    try:
        out = checkpoint(lambda h, m: model(h)[m], x * 1.0, m=mask, policy=policy)
    except RuntimeError as err:
        return str(err)
    out.sum().backward()
    return None


@pytest.mark.parametrize("world", [2, 3])
def test_check_replicated_fires_and_names_ranks(world):
    messages = run(world, _replica_check, world - 1)
    for msg in messages:
        assert msg is not None and "not identical" in msg
        assert f"args[0]: group ranks [{world - 1}] differ from group rank 0" in msg
        assert "kwargs" not in msg  # the bool mask is not partitioned, so not checked


@pytest.mark.parametrize("world", [2, 3])
def test_check_replicated_silent_when_replicated(world):
    assert run(world, _replica_check, -1) == [None] * world


def _model_parallel_subgroups():
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mp_group = groups[rank // 2]
    tracker = seed_model_parallel(1234, mp_group)
    with tracker.fork():
        draw = torch.rand(4)
    # partition over the 2-rank model-parallel group; data-parallel replicas differ in data
    ref = case_grads("block", ckpt=False, seed=rank // 2)
    got = case_grads("block", policy=CheckpointPolicy(partition_group=mp_group,
                                                      check_replicated=True), seed=rank // 2)
    return draw, ref, got


def test_seed_model_parallel_and_partition_over_subgroups():
    (d0, r0, g0), (d1, r1, g1), (d2, r2, g2), (d3, r3, g3) = run(4, _model_parallel_subgroups)
    assert not torch.equal(d0, d1) and not torch.equal(d2, d3)  # differ within a mp group
    assert torch.equal(d0, d2) and torch.equal(d1, d3)          # same across dp replicas
    for ref, got in [(r0, g0), (r1, g1), (r2, g2), (r3, g3)]:
        assert_all_equal(ref, got)
    assert not torch.equal(r0[0], r2[0])  # the two replicas really had different data


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(0, 2))
def test_differing_ranks_property(world, tensors, bad_rank_seed):
    gathered = torch.zeros(world, tensors, 2, dtype=torch.int64)
    assert differing_ranks(gathered) == {}
    if world > 1:
        bad = 1 + bad_rank_seed % (world - 1)
        gathered[bad, tensors - 1, 1] = 7
        assert differing_ranks(gathered) == {tensors - 1: [bad]}
        msg = replica_error([f"args[{i}]" for i in range(tensors)], differing_ranks(gathered),
                            list(range(world)))
        assert f"args[{tensors - 1}]: group ranks [{bad}] differ from group rank 0" in msg


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.integers(0, 10_000), st.sampled_from([torch.float32, torch.bfloat16]))
def test_checksum_detects_any_single_change(n, where, dtype):
    t = torch.randn(n).to(dtype)
    u = t.clone()
    i = where % n
    u[i] = -u[i] if u[i] != 0 else 1.0
    assert torch.equal(checksum(t), checksum(t.clone()))
    assert not torch.equal(checksum(t), checksum(u))
