"""DiskStore's IO paths: direct IO in place (aligned memory) and through a bounce buffer give the
same bytes; aligned buffers are the common case; reads are served ahead of queued writes."""

import os
import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from harness import run
from parts.offload import DiskStore, OffloadedOptimizer
from parts.offload import _fileio, parking
from parts.offload._fileio import ALIGN
from parts.partition import attach, detach, partitioned, shards

GUARD = 64  # bytes after each destination that a read must leave alone


def _direct_ok(path) -> bool:
    return _fileio.probe_direct(str(path))


def _placed(nbytes: int, misalign: int) -> torch.Tensor:
    """``nbytes`` of memory starting ``misalign`` bytes past an ``ALIGN`` boundary, then GUARD bytes of 0xAB."""
    raw = _fileio.aligned_buffer(misalign + nbytes + GUARD)
    raw.fill_(0xAB)
    return raw[misalign:misalign + nbytes]


def _guard(t: torch.Tensor) -> torch.Tensor:
    """The GUARD bytes right after ``t`` (same storage)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), t.storage_offset() + t.numel(), (GUARD,))


@settings(max_examples=30, deadline=None)
@given(n=st.sampled_from([1, 100, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN, 3 * ALIGN + 7, 40000]),
       src_mis=st.sampled_from([0, 1, 64, ALIGN - 64]), dst_mis=st.sampled_from([0, 1, 64, ALIGN - 64]),
       blocks=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_in_place_and_bounced_paths_give_the_same_bytes(tmp_path_factory, n, src_mis, dst_mis, blocks, seed):
    """Write from aligned / unaligned memory at a block offset, read into aligned / unaligned memory:
    the same bytes come back, the file holds the same bytes padded with zeros, and only the
    unaligned memory (or the last partial block) is copied; nothing past the destination is touched."""
    directory = tmp_path_factory.mktemp("io")
    if not _direct_ok(directory):
        pytest.skip("the file system refuses O_DIRECT")
    path, offset = os.path.join(directory, "f"), blocks * ALIGN
    g = torch.Generator().manual_seed(seed)
    src = _placed(n, src_mis)
    src.copy_(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8))
    scratch_bufs = []

    def scratch(nbytes):
        scratch_bufs.append(_fileio.aligned_buffer(nbytes))
        return scratch_bufs[-1]

    fd = _fileio.open_file(path, True)
    try:
        copied = _fileio.write_bytes(fd, path, src, offset, scratch)
        dst = _placed(n, dst_mis)
        read_copied = _fileio.read_bytes(fd, path, dst, offset, scratch)
    finally:
        os.close(fd)
    assert torch.equal(dst, src)
    assert torch.all(_guard(dst) == 0xAB)
    assert copied == (n % ALIGN if src_mis == 0 else n)
    assert read_copied == (n % ALIGN if dst_mis == 0 else n)
    with open(path, "rb") as f:
        f.seek(offset)
        on_disk = f.read(_fileio.round_up(n))
    assert on_disk[:n] == bytes(src.tolist()) and set(on_disk[n:]) <= {0}


@pytest.mark.parametrize("src_aligned,dst_aligned", [(True, True), (True, False), (False, True), (False, False)])
def test_store_moves_aligned_memory_in_place(tmp_path, src_aligned, dst_aligned):
    """Through the store (several pieces per transfer): exact bytes either way; bytes copied are the
    unaligned transfers whole and an aligned transfer's last partial block only."""
    with DiskStore(tmp_path, threads=3, block_bytes=2 * ALIGN) as store:
        if not store.direct:
            pytest.skip("the file system refuses O_DIRECT")
        n = 5 * ALIGN + 300
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        src, dst = _placed(n, 0 if src_aligned else 64), _placed(n, 0 if dst_aligned else 64)
        src.copy_(data)
        store.write("k", src).wait()
        store.read("k", dst).wait()
        assert torch.equal(dst, data) and torch.all(_guard(dst) == 0xAB)
        want = (300 if src_aligned else n) + (300 if dst_aligned else n)
        assert store.stats.bytes_bounced == want


def test_tensors_the_store_fills_are_aligned(tmp_path):
    """Parked tensors when loaded and ``empty_for_io`` buffers start ALIGN-aligned (64 KiB and up);
    a small one is left as the allocator gives it."""
    assert _fileio.is_aligned(parking.empty_for_io((70, 1000), torch.float32))
    assert parking.empty_for_io((3,), torch.float64).numel() == 3
    with DiskStore(tmp_path) as store:
        t = torch.arange(50000, dtype=torch.float32)
        parking.park(t, store, "t")
        for _ in range(3):
            parking.load(t)
            assert _fileio.is_aligned(t) and torch.equal(t, torch.arange(50000, dtype=torch.float32))
            parking.drop(t)


def _bounced_per_step(tmp):
    """A partitioned model (world 1) with shards and AdamW state on disk: bytes copied per step."""
    torch.manual_seed(0)
    store = DiskStore(tmp, block_bytes=1 << 16)
    with partitioned(remote_device=store):
        model = nn.Sequential(*[nn.Linear(128, 128, bias=False) for _ in range(4)])  # 64 KiB shards
    attach(model, prefetch_bucket_size=128 * 128, max_live_parameters=2 * 128 * 128)
    opt = OffloadedOptimizer(torch.optim.AdamW(shards(model), lr=1e-3), store)
    x, out = torch.randn(8, 128), []
    for _ in range(3):
        before = store.stats.snapshot()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        store.flush()
        io = store.stats.minus(before)
        out.append((io.bytes_bounced, io.bytes_read, io.bytes_written))
    detach(model)
    store.close()
    return store.direct, out


def test_training_steps_copy_nothing_once_state_exists(tmp_path):
    """Shards, their reduce-scattered grads and the optimizer's state tensors are all moved in
    place; only the first step's fresh AdamW state (allocated by torch) is copied."""
    direct, steps = run(1, _bounced_per_step, str(tmp_path))[0]
    if not direct:
        pytest.skip("the file system refuses O_DIRECT")
    (first, *_), rest = steps[0], steps[1:]
    # at most exp_avg and exp_avg_sq of 4 layers, written once each (one the allocator happened
    # to align is written in place)
    assert 0 < first <= 2 * 4 * 128 * 128 * 4, steps
    assert all(bounced == 0 and read > 0 and written > 0 for bounced, read, written in rest), steps


def test_a_read_is_not_held_behind_queued_writes_of_another_key(tmp_path, monkeypatch):
    """One IO thread, a slow writer holding it on the first piece of a write of key "a" (4 pieces):
    a read of "b" submitted meanwhile runs next, before a's remaining pieces; a read of "a"
    itself still waits for all of them and returns the written bytes."""
    log, entered, gate = [], threading.Event(), threading.Event()
    real_write, real_read = _fileio.OPS.pwritev, _fileio.OPS.preadv
    with DiskStore(tmp_path, threads=1, block_bytes=ALIGN, direct=False) as store:
        b = torch.arange(ALIGN // 4, dtype=torch.float32)
        store.write("b", b).wait()
        names = {os.path.join(store.directory, e.file): k for k, e in store._index.items()}

        def key_of(fd):
            return names.get(os.readlink(f"/proc/self/fd/{fd}"), "a")

        def slow_writer(fd, bufs, offset):
            if not entered.is_set():
                entered.set()
                assert gate.wait(60)  # held until the reads are queued (a guard, not a timing)
            log.append(("write", key_of(fd), offset))
            return real_write(fd, bufs, offset)

        def reader(fd, bufs, offset):
            log.append(("read", key_of(fd), offset))
            return real_read(fd, bufs, offset)

        monkeypatch.setattr(_fileio.OPS, "pwritev", slow_writer)
        monkeypatch.setattr(_fileio.OPS, "preadv", reader)
        a = torch.randn(ALIGN)  # 4 pieces
        handles = [store.write("a", a)]
        assert entered.wait(60)
        out_a, out_b = torch.empty_like(a), torch.empty_like(b)
        handles += [store.read("a", out_a), store.read("b", out_b)]
        gate.set()
        for h in handles:
            h.wait()
    assert torch.equal(out_a, a) and torch.equal(out_b, b)
    writes_a = [("write", "a", k * ALIGN) for k in range(4)]
    assert log == [writes_a[0], ("read", "b", 0)] + writes_a[1:] + [("read", "a", k * ALIGN) for k in range(4)]
