"""Tests of parts.observe: memory reports, storage accounting and timers."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from harness import run
from parts.observe import MemoryReport, Timers, memory_usage, storage_bytes
from parts.observe import memory as memory_mod
from parts.observe.memory import _fmt

MIB = 1 << 20


# ---------------------------------------------------------------- memory_usage

def test_memory_usage_is_noop_without_force_or_env(monkeypatch):
    monkeypatch.delenv("PARTS_MEMORY_LOG", raising=False)

    def boom(message=""):
        raise AssertionError("snapshot must not run when logging is off")

    monkeypatch.setattr(memory_mod, "snapshot", boom)
    assert memory_usage("hot loop") is None


def test_memory_usage_env_enables_and_prints(monkeypatch, capsys):
    monkeypatch.setenv("PARTS_MEMORY_LOG", "1")
    report = memory_usage("after init")
    assert isinstance(report, MemoryReport)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "after init" in out and "RSS" in out


def test_memory_usage_force_fields(monkeypatch, capsys):
    monkeypatch.delenv("PARTS_MEMORY_LOG", raising=False)
    report = memory_usage("forced", force=True)
    assert report.rank == 0 and report.message == "forced"
    assert report.rss_bytes > 10 * MIB and report.peak_rss_bytes >= report.rss_bytes
    assert 0 < report.system_used_bytes <= report.system_total_bytes
    assert report.device is None and report.allocated_bytes is None  # CPU-only machine
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.rss_bytes = 0
    assert str(report) in capsys.readouterr().out


def test_memory_usage_sees_allocation_and_peak_reset(monkeypatch, capsys):
    before = memory_usage("before", force=True)
    big = torch.ones(128 * MIB // 4)  # 128 MiB, touched
    during = memory_usage("during", force=True)
    assert during.rss_bytes - before.rss_bytes > 100 * MIB
    del big
    after = memory_usage("after", force=True, reset_peak=True)
    # /proc RSS counters are batched per CPU by the kernel (off by up to a few hundred KiB)
    assert after.peak_rss_bytes >= during.rss_bytes - 4 * MIB
    if not memory_mod.reset_peak_memory():
        pytest.skip("/proc/self/clear_refs is not writable here")
    reset = memory_usage("reset", force=True)
    # the 128 MiB block was returned to the OS (mmap'ed), so the reset peak is well below
    assert reset.peak_rss_bytes < during.peak_rss_bytes - 64 * MIB


def test_report_str_units():
    assert _fmt(None) == "n/a"
    assert _fmt(5 * MIB) == "5.0 MiB"
    assert _fmt(3 << 30) == "3.00 GiB"
    r = MemoryReport("m", 0, 5 * MIB, 6 * MIB, 1 << 30, 4 << 30, "cuda:0", 1 << 30, 2 << 30, 3 << 30)
    text = str(r)
    assert text.startswith("[rank 0] m | RSS 5.0 MiB (peak 6.0 MiB)")
    assert "cuda:0 allocated 1.00 GiB (peak 2.00 GiB) reserved 3.00 GiB" in text


def _memory_usage_on_rank():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        report = memory_usage("ranks", force=True)
    return report.rank, buf.getvalue()


def test_memory_usage_prints_on_rank0_only():
    (r0, out0), (r1, out1) = run(2, _memory_usage_on_rank)
    assert (r0, r1) == (0, 1)
    assert "[rank 0] ranks" in out0 and out1 == ""


# ---------------------------------------------------------------- storage_bytes

def test_storage_bytes_counts_views_once():
    a = torch.zeros(100)
    b = torch.zeros(10, dtype=torch.float64)
    assert storage_bytes([a, a[3:], {"k": a.view(10, 10)}, (b, b[2:5])]) == 480
    assert storage_bytes(a[:1]) == 400  # a slice holds the whole storage alive
    assert storage_bytes([None, 3, "x", torch.empty(0)]) == 0


def test_storage_bytes_modules_and_grads():
    lin = torch.nn.Linear(4, 3)
    bn = torch.nn.BatchNorm1d(3)
    assert storage_bytes(lin) == (12 + 3) * 4
    assert storage_bytes(bn) == (3 * 4) * 4 + 8  # weight, bias, running mean/var, num_batches (int64)
    lin(torch.ones(2, 4)).sum().backward()
    assert storage_bytes(lin, include_grads=True) == 2 * (12 + 3) * 4
    with pytest.raises(TypeError, match="object"):
        storage_bytes([object()])


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.integers(0, 3)), min_size=0, max_size=8))
def test_storage_bytes_property(sizes):
    bases = [torch.zeros(n, dtype=[torch.float32, torch.float64, torch.int8, torch.bfloat16][d])
             for n, d in sizes]
    views = [t[i % t.numel():] for i, t in enumerate(bases)]
    expected = sum(t.numel() * t.element_size() for t in bases)
    assert storage_bytes(bases + views + bases) == expected


# ---------------------------------------------------------------- Timers

class FakeClock:
    """A clock that returns the listed instants in order."""

    def __init__(self, *times):
        self._it = itertools.chain(times, itertools.count(1000))

    def __call__(self):
        return next(self._it)


def test_timer_accumulates_count_mean_reset():
    timers = Timers(clock=FakeClock(0.0, 1.0, 5.0, 8.0))
    fwd = timers("forward")
    assert timers("forward") is fwd
    fwd.start()
    fwd.stop()
    fwd.start()
    fwd.stop()
    assert fwd.count == 2 and fwd.mean() == 2.0
    assert fwd.elapsed(reset=False) == 4.0
    assert fwd.elapsed() == 4.0
    assert fwd.elapsed() == 0.0 and fwd.count == 0 and fwd.mean() == 0.0


def test_timer_elapsed_while_running_keeps_running():
    timers = Timers(clock=FakeClock(10.0, 12.0, 12.0, 15.0))
    t = timers("step").start()
    assert t.elapsed() == 2.0 and t.running
    t.stop()
    assert t.elapsed() == 3.0


def test_timer_misuse_names_the_timer():
    timers = Timers()
    with pytest.raises(RuntimeError, match="'fwd' is not started"):
        timers("fwd").stop()
    timers("fwd").start()
    with pytest.raises(RuntimeError, match="'fwd' is already started"):
        timers("fwd").start()
    with pytest.raises(ValueError, match="normalizer"):
        timers.log(["fwd"], normalizer=0)


def test_timer_context_manager_and_real_clock():
    timers = Timers()
    with timers("matmul"):
        torch.ones(64, 64) @ torch.ones(64, 64)
    assert timers("matmul").count == 1 and timers("matmul").elapsed() > 0.0


def test_timers_log_local():
    lines = []
    timers = Timers(clock=FakeClock(0.0, 0.5, 1.0, 4.0))
    timers("a").start()
    timers("a").stop()
    timers("b").start()
    timers("b").stop()
    out = timers.log(["a", "b", "never"], normalizer=2.0, printer=lines.append)
    assert out == {"a": (0.25, 0.25), "b": (1.5, 1.5), "never": (0.0, 0.0)}
    assert lines == ["time (ms) min/max | a: 250.00/250.00 | b: 1500.00/1500.00 | never: 0.00/0.00"]
    assert timers("a").elapsed() == 0.0  # log resets by default


def _log_two_ranks():
    import torch.distributed as dist
    rank = dist.get_rank()
    timers = Timers(clock=FakeClock(0.0, 1.0 + rank, 10.0, 10.0 + 3.0 * (1 - rank)))
    timers("fwd").start()
    timers("fwd").stop()
    timers("bwd").start()
    timers("bwd").stop()
    lines = []
    result = timers.log(["fwd", "bwd"], normalizer=1.0, printer=lines.append)
    return result, lines


def test_timers_log_min_max_across_ranks():
    (res0, lines0), (res1, lines1) = run(2, _log_two_ranks)
    assert res0 == res1 == {"fwd": (1.0, 2.0), "bwd": (0.0, 3.0)}
    assert lines0 == ["time (ms) min/max | fwd: 1000.00/2000.00 | bwd: 0.00/3000.00"]
    assert lines1 == []


def _apply_threshold(num_bytes):
    import parts.observe as observe
    return observe.set_mmap_threshold(num_bytes)


def test_mmap_threshold_is_applied_on_glibc():
    """mallopt accepts it (its RSS effect is measured in benchmarks/bench_zero3.py, not here:
    whether glibc keeps a freed block depends on allocation order, too fragile for a test)."""
    import parts.observe as observe
    if observe.allocator._libc() is None:
        pytest.skip("not glibc")
    from harness import run
    assert run(1, _apply_threshold, 128 * 1024) == [True]


def test_mmap_threshold_rejects_bad_sizes():
    import parts.observe as observe
    with pytest.raises(ValueError, match="num_bytes must be a positive int"):
        observe.set_mmap_threshold(0)
