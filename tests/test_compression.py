"""Compressed collectives as a policy (``attach(model, compression=Compression(...))``): off is
today's training bitwise; int8 weights gather bitwise what quantizing each shard gives; int8 /
int4 grads with error feedback keep the sum of the true grads up to the residuals, on every
rank; the ledger counts the codes (at most 0.27x the fp32 bytes); hybrid and two-hop layouts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness import run

STEPS, LR, WIDTH = 3, 0.05, 128


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))


def _batches(steps: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)) for _ in range(steps)]


def _layout(kind: str) -> dict:
    """``partitioned`` arguments: full sharding ("flat"), 2 x 2 hybrid ("hybrid"), two nodes of two ("nodes")."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    if kind == "hybrid":
        return {"mesh": init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))}
    return {"ranks_per_node": 2} if kind == "nodes" else {}


def _policy(spec):
    from parts.partition import Compression
    return None if spec is None else Compression(**spec)


def _train(kind: str, spec, steps: int = STEPS, persistence: int = 100, precision: bool = False,
           sync: str = "step", secondary: bool = False, bucket: int = 5_000_000):
    """SGD on this rank's rows: the full state (every rank), the losses, the ledger since the start."""
    import torch.distributed as dist
    from parts.comm import comm_counter
    from parts.comm.counter import ledger_since
    from parts.partition import MixedPrecision, attach, full_state_dict, partitioned, set_replica_sync, shards
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100)
    with partitioned(**_layout(kind)):
        model = _model()
    knobs = {"compression": _policy(spec)} if spec != "absent" else {}
    if secondary:  # node-local backward gathers (ZeRO++ hpZ) beside the compressed across hops
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
        knobs["secondary_group"] = pairs[rank // 2]
    coordinator = attach(model, persistence_threshold=persistence, reduce_bucket_size=bucket,
                         mixed_precision=MixedPrecision() if precision else None, **knobs)
    if kind == "hybrid":
        set_replica_sync(coordinator, sync)
    opt = torch.optim.SGD(shards(model), lr=LR)
    before, losses = comm_counter.by_group(), []
    for x, y in _batches(steps, 4 * world):
        loss = nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    stats, ledger = coordinator.stats(), ledger_since(before, comm_counter.by_group())
    return full_state_dict(model, rank0_only=False), losses, ledger, stats


def test_off_is_todays_training_bitwise_with_the_same_bytes():
    absent, none, empty = (run(2, _train, "flat", spec) for spec in ("absent", None, {}))
    for other in (none, empty):
        for a, b in zip(absent, other):
            assert all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1] == b[1] and a[2] == b[2]
            assert b[3].residual_bytes == 0


def _captured_weights(spec, precision: bool):
    """The full weights every Linear computes with in one forward, and the fp32 masters."""
    import torch.distributed as dist
    from parts.partition import MixedPrecision, attach, gathered, partitioned
    torch.manual_seed(100)
    with partitioned():
        model = _model()
    attach(model, persistence_threshold=200, compression=_policy(spec),
           mixed_precision=MixedPrecision() if precision else None)
    seen = {}
    for name, sub in model.named_modules():
        if isinstance(sub, nn.Linear):
            sub.register_forward_hook(lambda m, a, o, name=name: seen.update(
                {f"{name}.weight": m.weight.detach().clone(), f"{name}.bias": m.bias.detach().clone()}))
    model(torch.randn(2, 16))
    with gathered(model.parameters()):
        masters = {k: v.detach().clone() for k, v in model.named_parameters()}
    return seen, masters, dist.get_world_size()


@pytest.mark.parametrize("precision", [False, True])
def test_int8_weights_gather_bitwise_what_quantizing_each_shard_gives(precision):
    from parts.comm.quantize import dequantize, quantize
    for seen, masters, world in run(2, _captured_weights, {"weights": "int8", "block": 32}, precision):
        for name, full in seen.items():  # 128-element bias: persistent (flat buffer); the rest per parameter
            flat = masters[name].reshape(-1)
            shard = -(-flat.numel() // world)
            rows = torch.cat([flat, flat.new_zeros(world * shard - flat.numel())]).view(world, shard)
            expected = dequantize(quantize(rows, 32, 8), full.dtype).reshape(-1)[:flat.numel()]
            assert torch.equal(full.reshape(-1), expected), name
            assert not torch.equal(full.float(), masters[name])  # really quantized


def test_int8_weights_train_close_to_fp32_and_the_ledger_counts_the_codes():
    off = run(2, _train, "flat", None, persistence=0)[0]
    on = run(2, _train, "flat", {"weights": "int8", "grads": "int8"}, persistence=0)[0]
    for k in off[0]:
        torch.testing.assert_close(on[0][k], off[0][k], rtol=0, atol=2e-2)
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(on[1], off[1]))
    group = "0,1"
    for kind in ("allgather_bytes", "reduce_scatter_bytes"):
        assert on[2][group][kind] <= 0.27 * off[2][group][kind], (kind, on[2][group], off[2][group])
    assert on[3].residual_bytes > 0


def test_bf16_compute_with_persistent_buffers_and_int4_grads_trains_close_to_uncompressed():
    off = run(2, _train, "flat", None, persistence=20_000, precision=True)[0]
    on = run(2, _train, "flat", {"weights": "int8", "grads": "int4"}, persistence=20_000, precision=True)[0]
    for k in off[0]:  # the flat persistent buffer (every parameter here) gathers and reduces as codes
        torch.testing.assert_close(on[0][k], off[0][k], rtol=0, atol=3e-2)
    ratio = on[2]["0,1"]["reduce_scatter_bytes"] / off[2]["0,1"]["reduce_scatter_bytes"]
    assert ratio <= 0.27, ratio  # int4 codes against the bf16 grads that travel uncompressed
    assert on[3].residual_bytes > 0


def _feedback_invariant(bits: str, micro: int = 3):
    """Grads of ``micro`` backwards (no step) accumulated in the grad shards, the true grads of
    every rank (an unsharded copy on the same rows) and every rank's residuals."""
    import torch.distributed as dist
    from parts.comm import all_gather_list, group_info
    from parts.partition import attach, full_state_dict, meta, partitioned
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100)
    with partitioned():
        model = _model()
    plain = _model()
    plain.load_state_dict(full_state_dict(model, rank0_only=False))
    attach(model, persistence_threshold=0, compression=_policy({"grads": bits, "block": 64}))
    for x, y in _batches(micro, 4 * world):
        for net in (model, plain):
            nn.functional.mse_loss(net(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    info = group_info(None, "test")
    out = []
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        m = meta(p)
        residuals = all_gather_list(m.compression.feedback.residual(m.id), info)
        true = all_gather_list(q.grad.reshape(-1), info)
        out.append((name, m.grad_shard.clone(), m.layout.range(rank), true, residuals))
    return out


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_error_feedback_keeps_the_sum_of_the_true_grads_up_to_the_residuals_on_every_rank(bits):
    """Each rank's accumulated grad shard equals the mean over ranks of the true grads summed
    over micro-batches, minus the mean of what every rank still owes it (their residual rows):
    up to fp32 rounding, 1e-5 of the largest grad here; without the residuals it is far off."""
    world = 2
    for rank, params in enumerate(run(world, _feedback_invariant, bits)):
        for name, got, (start, stop), true, residuals in params:
            shard = got.numel()
            true_mean = torch.stack([t for t in true]).double().mean(0)
            padded = torch.cat([true_mean, true_mean.new_zeros(world * shard - true_mean.numel())])
            owed = torch.stack([r[rank] for r in residuals]).double().mean(0)
            expected = padded.view(world, shard)[rank] - owed
            tol = 1e-5 * float(padded.abs().max())
            assert (got.double() - expected).abs().max() <= tol, name
            if owed.abs().max() > 10 * tol:  # the residuals matter: the test can fail
                assert (got.double() - padded.view(world, shard)[rank]).abs().max() > tol


def test_hybrid_replicas_stay_identical_the_cross_replica_mean_travels_as_codes():
    off = run(4, _train, "hybrid", None, persistence=0)
    on = run(4, _train, "hybrid", {"grads": "int8", "on": "replicas"}, persistence=0)
    at_backward = run(4, _train, "hybrid", {"grads": "int8", "on": "replicas"}, persistence=0, sync="backward",
                      bucket=4000)  # several buckets, each mean issued as its grads land, overlapped
    for ranks in (on, at_backward):
        for rank in range(1, 4):
            assert all(torch.equal(ranks[rank][0][k], ranks[0][0][k]) for k in ranks[0][0])
    for k in on[0][0]:  # other buckets: other residuals, the same means up to the codes' error
        torch.testing.assert_close(at_backward[0][0][k], on[0][0][k], rtol=0, atol=2e-2)
    for k in off[0][0]:
        torch.testing.assert_close(on[0][0][k], off[0][0][k], rtol=0, atol=2e-2)
    shard_group, replica_group = "0,1", "0,2"
    assert on[0][2][shard_group] == off[0][2][shard_group]  # on="replicas": the shard group in full precision
    assert on[0][2][replica_group]["all_reduce_bytes"] <= 0.27 * off[0][2][replica_group]["all_reduce_bytes"]


@pytest.mark.parametrize("secondary", [False, True])
def test_two_nodes_compress_the_across_hop_only_and_train_close(secondary):
    off = run(4, _train, "nodes", None, persistence=0, secondary=secondary)
    on = run(4, _train, "nodes", {"weights": "int8", "grads": "int8", "on": "replicas"}, persistence=0,
             secondary=secondary)
    for k in off[0][0]:
        torch.testing.assert_close(on[0][0][k], off[0][0][k], rtol=0, atol=2e-2)
    node, across = "0,1", "0,2"
    assert on[0][2][node]["reduce_scatter_bytes"] == off[0][2][node]["reduce_scatter_bytes"]
    for kind in ("allgather_bytes", "reduce_scatter_bytes"):
        assert on[0][2][across][kind] <= 0.27 * off[0][2][across][kind], kind


@pytest.mark.parametrize("bad, match", [
    (dict(weights="int4"), "weights"), (dict(grads="fp8"), "grads"), (dict(on="nodes"), "on"),
    (dict(block=0), "block"), (dict(block=True), "block")])
def test_a_bad_policy_is_refused_naming_the_field(bad, match):
    from parts.partition import Compression
    with pytest.raises(ValueError, match=match):
        Compression(**bad)


def test_attach_refuses_a_compression_that_is_not_a_policy():
    from parts.partition import FetchCoordinator
    with pytest.raises(TypeError, match="compression"):
        FetchCoordinator(compression="int8")
