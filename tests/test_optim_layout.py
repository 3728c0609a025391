"""Property tests of the flat-buffer arithmetic and of the bf16 buffer round trip at world 1..4."""

from __future__ import annotations

import torch
import torch.distributed as dist
from harness import run
from hypothesis import given, settings
from hypothesis import strategies as st

from parts.optim import BF16Optimizer
from parts.optim.layout import PARTITION_ALIGN, GroupLayout, plan_buckets, source_ranges

numels = st.lists(st.integers(0, 300), min_size=1, max_size=8)


@settings(max_examples=30, deadline=None)
@given(numels, st.integers(1, 4))
def test_partitions_equal_aligned_and_cover(sizes: list[int], world: int) -> None:
    """Equal aligned partitions; pieces cover every real element exactly once, padding none."""
    layout = GroupLayout(tuple(sizes), world)
    n = layout.partition_numel
    assert n % PARTITION_ALIGN == 0 and layout.padded_numel == n * world >= sum(sizes)
    seen = [[False] * s for s in sizes]
    for rank in range(world):
        for pc in layout.pieces(rank):
            assert 0 <= pc.offset and pc.offset + pc.stop - pc.start <= n
            flat = layout.offsets[pc.index] + pc.start
            assert flat == rank * n + pc.offset  # the piece sits where the flat buffer says
            for e in range(pc.start, pc.stop):
                assert not seen[pc.index][e]
                seen[pc.index][e] = True
    assert all(all(s) for s in seen)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 200), min_size=1, max_size=5), st.integers(1, 4),
       st.integers(1, 500))
def test_bucket_plan(parts: list[int], world: int, size: int) -> None:
    """Buckets hold at most `size` gathered elements and cover every partition element once."""
    if size < world:
        return
    buckets = plan_buckets(parts, size, world)
    covered = [[0] * p for p in parts]
    for bucket in buckets:
        used = 0
        for bp in bucket:
            assert bp.offset == used
            used += bp.stop - bp.start
            for e in range(bp.start, bp.stop):
                covered[bp.group][e] += 1
        assert 0 < used * world <= size
    assert all(c == 1 for cov in covered for c in cov)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 500), st.integers(0, 500), st.integers(1, 64))
def test_source_ranges(a: int, b: int, shard: int) -> None:
    """Splitting a flat range by owner is contiguous and stays inside each owner's partition."""
    start, stop = min(a, b), max(a, b)
    pos = start
    for rank, lo, hi in source_ranges(start, stop, shard):
        assert rank * shard + lo == pos and 0 <= lo < hi <= shard
        pos = rank * shard + hi
    assert pos == stop


def roundtrip_body(shapes: list[list[tuple[int, ...]]], bucket: int):
    """Rank-dependent masters gather into every rank's bf16 params bitwise; padding stays out."""
    rank = dist.get_rank()
    torch.manual_seed(7)
    params = [[torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in g] for g in shapes]
    inner = torch.optim.SGD([{"params": g} for g in params], lr=0.0)
    opt = BF16Optimizer(inner, allgather_bucket_size=bucket)
    originals = [[p.detach().clone() for p in g] for g in params]
    same = all(torch.equal(p, o) for g, og in zip(params, originals) for p, o in zip(g, og))
    for fg in opt.flat_groups:  # rank-dependent values in the masters
        fg.master.add_(rank + 1)
        fg.master[fg.real_numel():] = float("nan")  # poisoned padding must never reach a param
    opt.write_back()
    shifted = []
    for fg, og in zip(opt.flat_groups, originals):
        part = fg.layout.partition_numel
        for i, (p, o) in enumerate(zip(fg.params, og)):
            owner = torch.arange(p.numel()).add(fg.layout.offsets[i]).div(part, rounding_mode="floor")
            expect = (o.float().reshape(-1) + owner + 1).to(torch.bfloat16).view(p.shape)
            shifted.append(torch.equal(p, expect))
            shifted.append(p.untyped_storage().data_ptr() == fg.flat.untyped_storage().data_ptr())
        pad = fg.flat[fg.layout.numel:]
        shifted.append(bool((pad == 0).all()))  # master padding was zeroed before the gather
    return same, all(shifted)


shapes_st = st.lists(st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
                              min_size=1, max_size=4), min_size=1, max_size=3)


@settings(max_examples=12, deadline=None)
@given(shapes_st, st.integers(1, 4), st.integers(64, 2000))
def test_flatten_partition_gather_roundtrip(shapes, world: int, bucket: int) -> None:
    """Flatten -> per-rank fp32 partition -> bucketed all-gather round-trips bitwise at world 1..4."""
    assert run(world, roundtrip_body, shapes, bucket) == [(True, True)] * world


def padding_body():
    """Gradient padding never reaches the norm: poison the grad buffer padding, norm unchanged."""
    rank = dist.get_rank()
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(37).to(torch.bfloat16))
    opt = BF16Optimizer(torch.optim.SGD([p], lr=0.1))
    (p.float() * (rank + 1)).sum().backward()
    fg = opt.flat_groups[0]
    opt._reduce_grads()
    clean = float(opt._global_norm(opt._local_grads()))
    fg.part_grad[fg.real_numel():] = 1e30  # poison: must not be read
    poisoned = float(opt._global_norm(opt._local_grads()))
    return clean, poisoned


def test_padding_never_enters_norm() -> None:
    """37 elements over 3 ranks leave padding on every rank; the norm ignores it."""
    out = run(3, padding_body)
    world = 3
    expect = (37 * (sum(range(1, world + 1)) / world) ** 2) ** 0.5
    for clean, poisoned in out:
        assert clean == poisoned
        assert abs(clean - expect) < 1e-4 * expect
