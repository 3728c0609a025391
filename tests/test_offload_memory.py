"""An offloaded run's peak RSS growth stays under memory_bound, on a model whose states are >= 4x it."""

import os
import subprocess
import sys

import pytest

from parts.offload import OffloadBudget, memory_bound


def test_bound_adds_the_terms():
    b = OffloadBudget(max_live_parameters=10, prefetch_bucket_size=5, itemsize=4, world_size=2,
                      chunk_bytes=100, store_threads=2, block_bytes=8, max_inflight_bytes=50,
                      reuse_bytes=9, reduce_bucket_size=3, read_ahead=7, largest_step_bytes=160)
    assert memory_bound(b, activations=11) == 60 + 16 + 480 + 75 + 24 + (16 + 480 + 24) // 16 + 11


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
