"""An offloaded run's peak RSS growth stays under memory_bound, on a model whose states are >= 4x it,
and grows with the model's depth at most a quarter as fast as an in-memory run's at every width;
a memory budget sizes knobs whose bound fits in it, and refuses a parameter it cannot hold."""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from parts.offload import DiskStore, OffloadBudget, OffloadedOptimizer, memory_bound
from parts.offload.plan import default_budget, min_budget, split_budget
from parts.partition import partitioned, shards


def test_bound_adds_the_terms():
    b = OffloadBudget(max_live_parameters=10, prefetch_bucket_size=5, itemsize=4, world_size=2,
                      chunk_bytes=100, store_threads=2, block_bytes=8, max_inflight_bytes=50,
                      reuse_bytes=9, reduce_bucket_size=3, read_ahead=7, largest_step_bytes=160)
    assert memory_bound(b, activations=11) == 60 + 16 + 480 + 75 + 24 + (16 + 480 + 24) // 16 + 11


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["after-backward", "in-backward"])
def test_peak_rss_growth_under_bound(tmp_path, mode):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    job = os.path.join(os.path.dirname(__file__), "offload_memory_job.py")
    out = subprocess.run([sys.executable, job, str(tmp_path), mode], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    growth, bound, states = map(int, out.stdout.split())
    assert states >= 4 * bound, (states, bound)
    assert 0 < growth <= bound, f"peak RSS grew {growth / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB"


# (width, two depths): each pair beyond the depth at which an offloaded run's windows are full
# (benchmarks/bench_offload_memory.py runs 4096 and 8192, deeper)
SWEEP = {512: (8, 24), 1024: (4, 12), 2048: (4, 6)}


def _sweep(path, mode: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    env.pop("MALLOC_MMAP_THRESHOLD_", None)  # the store's own setting is what is tested
    job = os.path.join(os.path.dirname(__file__), "offload_memory_job.py")
    specs = [f"{w}:{a},{b}" for w, (a, b) in SWEEP.items()]
    return subprocess.Popen([sys.executable, job, str(path), "sweep", mode, *specs], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _per_layer(out: str) -> dict[int, tuple[float, list[tuple[int, int]]]]:
    """width -> (peak RSS growth per added layer, [(growth, bound)] of its runs)."""
    runs: dict[int, list[tuple[int, int, int]]] = {}
    for row in out.strip().splitlines():
        width, layers, growth, bound = map(int, row.split())
        runs.setdefault(width, []).append((layers, growth, bound))
    return {w: ((r[1][1] - r[0][1]) / (r[1][0] - r[0][0]), [(g, b) for _, g, b in r]) for w, r in runs.items()}


@pytest.mark.slow
def test_offloaded_growth_per_layer_is_a_quarter_of_in_memory_at_every_width(tmp_path):
    jobs = {mode: _sweep(tmp_path / mode, mode) for mode in ("offload", "memory")}  # side by side
    outs = {}
    for mode, job in jobs.items():
        out, err = job.communicate(timeout=600)
        assert job.returncode == 0, err
        outs[mode] = _per_layer(out)
    for width in SWEEP:
        offloaded, runs = outs["offload"][width]
        in_memory, _ = outs["memory"][width]
        # the reference grew with the model (its states take 16 bytes per parameter)
        assert in_memory >= 4 * width * width, f"width {width}: in memory grew {in_memory / 2**20:.1f} MiB per layer"
        assert offloaded <= 0.25 * in_memory, \
            f"width {width}: {offloaded / 2**20:.1f} MiB per layer offloaded, {in_memory / 2**20:.1f} in memory"
        for growth, bound in runs:
            assert 0 < growth <= bound, f"width {width}: grew {growth / 2**20:.1f} MiB, bound {bound / 2**20:.1f}"


@settings(max_examples=200, deadline=None)
@given(budget=st.integers(1 << 20, 1 << 40), world=st.integers(1, 64), threads=st.integers(1, 16),
       block=st.sampled_from([1 << 12, 1 << 20, 8 << 20, 64 << 20]))
def test_knobs_sized_by_a_budget_keep_the_bound_within_it(budget, world, threads, block):
    if budget < 64 * 4096 * threads:
        with pytest.raises(ValueError, match="too small"):
            split_budget(budget, threads, block)
        return
    split = split_budget(budget, threads, block)
    knobs = split.attach_knobs(4)
    b = OffloadBudget(itemsize=4, world_size=world, chunk_bytes=split.chunk_bytes, store_threads=threads,
                      block_bytes=split.block_bytes, max_inflight_bytes=split.max_inflight_bytes,
                      reuse_bytes=split.reuse_bytes, read_ahead=2 * knobs["prefetch_bucket_size"], **knobs)
    assert memory_bound(b) <= 0.91 * budget
    assert split.block_bytes <= block and split.block_bytes % 4096 == 0


@given(step=st.integers(1, 1 << 36), threads=st.integers(1, 8))
def test_min_budget_is_the_smallest_whose_chunk_holds_the_step(step, threads):
    least = min_budget(step, threads, 8 << 20)
    assert split_budget(least, threads, 8 << 20).chunk_bytes >= step
    if least - 64 > 64 * 4096 * threads:
        assert split_budget(least - 64, threads, 8 << 20).chunk_bytes < step


@given(gib=st.integers(0, 1 << 12), extra=st.integers(0, (1 << 30) - 1), ranks=st.integers(1, 16))
def test_default_budget_is_the_same_within_a_gib_of_available_memory(gib, extra, ranks):
    """Ranks that read the available memory a moment apart (within the same whole GiB) get one
    budget, so the knobs sized from it agree."""
    assert default_budget((gib << 30) + extra, ranks) == default_budget(gib << 30, ranks)


def test_default_budget_shares_available_memory_among_local_ranks(tmp_path, monkeypatch):
    assert default_budget(64 << 30, 2) == 2 << 30 and default_budget(64 << 30, 4) == 1 << 30
    assert default_budget(1 << 30, 8) == 512 << 20 and default_budget(1 << 50, 1) == 16 << 30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with DiskStore(tmp_path) as two:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        with DiskStore(tmp_path) as one:
            assert not one.budget.given and "LOCAL_WORLD_SIZE" in one.budget.reason
            assert one.max_inflight_bytes > two.max_inflight_bytes
            assert abs(one.budget.memory_budget - 2 * two.budget.memory_budget) <= max(
                one.budget.memory_budget // 10, 1 << 20) or two.budget.memory_budget == 512 << 20


def test_a_budget_sizes_the_store_and_the_optimizer_chunk(tmp_path):
    with DiskStore(tmp_path, memory_budget=256 << 20) as store:
        split = store.budget
        assert (store.max_inflight_bytes, store.reuse.capacity) == (split.max_inflight_bytes, split.reuse_bytes)
        assert store.block_bytes == split.block_bytes
        optimizer = OffloadedOptimizer(torch.optim.AdamW([torch.nn.Parameter(torch.ones(8))]), store)
        assert optimizer.chunk_bytes == split.chunk_bytes
    with DiskStore(tmp_path, memory_budget=256 << 20, max_inflight_bytes=1 << 20, reuse_bytes=0) as store:
        assert (store.max_inflight_bytes, store.reuse.capacity) == (1 << 20, 0)  # given knobs win


def test_a_budget_too_small_for_the_largest_parameter_names_it(tmp_path):
    with DiskStore(tmp_path, memory_budget=16 << 20) as store:
        with partitioned(remote_device=store):
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(512, 512))
        with pytest.raises(ValueError, match=r"too small for 'shard of weight' \(262144 elements") as e:
            OffloadedOptimizer(torch.optim.AdamW(shards(model)), store)
        need = int(str(e.value).rsplit(">= ", 1)[1])
    with DiskStore(tmp_path, memory_budget=need) as store:
        with partitioned(remote_device=store):
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(512, 512))
        OffloadedOptimizer(torch.optim.AdamW(shards(model)), store)  # the budget it named is enough
