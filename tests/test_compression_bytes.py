"""What a compressed weight gather costs: ``gather_bytes`` (codes, fp32 scales and the row's
alignment, from numel, block and world) is the size of the wire rows the quantizer makes, and
``stats().allgather_bytes`` of a model with ``Compression(weights="int8")`` counts it: the ledger's
bytes, per parameter and for the flat persistent buffer, at world 2 and 3 (uneven shards)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from harness import run
from parts.comm.compressed import Codec, gather_bytes, gather_shares, to_wire
from parts.comm.quantize import code_bytes, num_blocks, quantize

pieces = st.lists(st.integers(0, 700), min_size=1, max_size=5)
codecs = st.builds(Codec, st.sampled_from([8, 4]), st.integers(1, 300))


@settings(deadline=None, max_examples=80)
@given(pieces, st.integers(1, 6), codecs, st.integers(0, 2 ** 31 - 1))
def test_gather_bytes_are_the_wire_rows_the_quantizer_makes(numels, world, codec, seed):
    g = torch.Generator().manual_seed(seed)
    rows = to_wire([quantize(torch.randn(1, n, generator=g), codec.block, codec.bits) for n in numels])
    assert gather_bytes(numels, world, codec) == (world - 1) * rows.shape[1]
    raw = [(world - 1) * (4 * num_blocks(n, codec.block) + code_bytes(n, codec.bits)) for n in numels]
    shares = gather_shares(numels, world, codec)
    assert sum(shares) == gather_bytes(numels, world, codec)  # per parameter, they add up to the gather
    assert shares[:-1] == raw[:-1] and 0 <= shares[-1] - raw[-1] <= 3 * (world - 1)  # alignment to 4 bytes


@settings(deadline=None, max_examples=40)
@given(st.integers(1, 100_000), st.integers(2, 64), st.sampled_from([64, 128, 256, 1024]))
def test_int8_codes_cost_a_quarter_of_fp32_and_a_scale_per_block(numel, world, block):
    fp32 = (world - 1) * 4 * numel
    expected = (world - 1) * (-(-(numel + 4 * num_blocks(numel, block)) // 4) * 4)
    assert gather_bytes([numel], world, Codec(8, block)) == expected
    if numel >= 4 * block:  # the scales and alignment are small beside the codes
        assert expected <= (0.25 + 2 / block) * fp32


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 37), nn.Tanh(), nn.Linear(37, 4))


def _train(spec, persistence: int, steps: int = 2):
    """SGD steps of ``_model`` under ``spec``: the last step's stats, the shard group's key and the
    shard sizes."""
    import torch.distributed as dist
    from parts.partition import Compression, attach, meta, partitioned, shards
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100)
    with partitioned():
        model = _model()
    coordinator = attach(model, persistence_threshold=persistence,
                         compression=Compression(**spec) if spec is not None else None)
    opt = torch.optim.SGD(shards(model), lr=0.05)
    g = torch.Generator().manual_seed(7 + rank)
    for _ in range(steps):
        model(torch.randn(4, 16, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    sizes = [meta(p).layout.shard_numel for p in model.parameters()]
    return coordinator.stats(), ",".join(str(r) for r in range(world)), sizes


@pytest.mark.parametrize("world", [2, 3])
def test_stats_count_the_codes_of_per_parameter_and_flat_gathers_as_the_ledger_does(world):
    block = 32
    spec = {"weights": "int8", "grads": "int8", "block": block}
    for persistence in (0, 100_000):  # every parameter on its own; all in the flat persistent buffer
        for rank, (on, (off, group, sizes)) in enumerate(zip(run(world, _train, spec, persistence),
                                                             run(world, _train, None, persistence))):
            stats = on[0]
            ledger = stats.bytes_by_group[group]
            assert stats.allgather_bytes == ledger["allgather_bytes"], (persistence, rank)
            assert stats.reduce_scatter_bytes == ledger["reduce_scatter_bytes"], (persistence, rank)
            assert stats.allgather_bytes <= 0.3 * off.allgather_bytes
            if persistence:  # one flat gather of every shard at the step's start
                assert stats.allgather_bytes == gather_bytes(sizes, world, Codec(8, block))


def _step_bytes(weights: bool, regather: bool) -> dict:
    """The byte counter's totals of one SGD step (after a first) at this world size, ``_wide`` model;
    ``regather``: every parameter gathered in forward and again in backward (no persistence, no reuse)."""
    from parts.comm import comm_counter
    from parts.partition import Compression, attach, partitioned, shards
    torch.manual_seed(100)
    with partitioned():
        model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 64))
    knobs = dict(persistence_threshold=0, max_reuse_distance=0) if regather else {}
    attach(model, compression=Compression(weights="int8") if weights else None, **knobs)
    opt = torch.optim.SGD(shards(model), lr=0.05)
    for step in range(2):
        before = comm_counter.snapshot()
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    after = comm_counter.snapshot()
    return {k: after[k] - before[k] for k in ("allgather_bytes", "reduce_scatter_bytes", "all_reduce_bytes")}


def _ratios() -> dict:
    return {regather: (_step_bytes(False, regather), _step_bytes(True, regather)) for regather in (False, True)}


def test_int8_weights_alone_carry_the_gathers_share_in_codes_and_the_grads_in_fp32():
    out = run(4, _ratios)[0]
    for regather, (off, on) in out.items():
        assert on["reduce_scatter_bytes"] == off["reduce_scatter_bytes"]  # the grads stay fp32
        assert on["allgather_bytes"] <= 0.26 * off["allgather_bytes"]  # every gather moves codes
        ratio = sum(on.values()) / sum(off.values())
        if regather:  # two gathers per reduce-scatter: (2 x 0.254 + 1) / 3
            assert off["allgather_bytes"] == 2 * off["reduce_scatter_bytes"] and ratio <= 0.51
        else:  # gathered once per step (persistent, or kept from forward to backward): (0.254 + 1) / 2
            assert off["allgather_bytes"] == off["reduce_scatter_bytes"] and 0.62 <= ratio <= 0.63
