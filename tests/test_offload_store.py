"""DiskStore: bytes round-trip exactly, operations on a key stay ordered, faults are loud."""

import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings, strategies as st

from parts.offload import DiskFullError, DiskStore
from parts.offload import _fileio

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8,
          torch.uint8, torch.bool, torch.complex64]
SIZES = st.sampled_from([0, 1, 3, 1023, 1024, 1025, 4095, 4097, 9000])


def _tensor(dtype, numel, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    if not dtype.is_floating_point and not dtype.is_complex:
        return torch.randint(-100 if dtype.is_signed else 0, 100, (numel,), generator=g).to(dtype)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def store(request, tmp_path):
    s = DiskStore(tmp_path, threads=3, block_bytes=4096, max_inflight_bytes=1 << 16,
                  direct=request.param)
    yield s
    s.close()


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["k", "key/with/slash", "é", ""]),
                              st.sampled_from(DTYPES), SIZES), min_size=1, max_size=8))
def test_round_trip_against_a_dict(tmp_path_factory, ops):
    """Writes (some overwriting a key with another size or dtype) read back bitwise, in both modes."""
    for direct in (True, False):
        with DiskStore(tmp_path_factory.mktemp("s"), threads=2, block_bytes=4096, direct=direct) as s:
            model, handles = {}, []
            for n, (key, dtype, numel) in enumerate(ops):
                model[key] = _tensor(dtype, numel, n)
                handles.append(s.write(key, model[key]))
            outs = {k: torch.empty_like(v) for k, v in model.items()}
            reads = [s.read(k, outs[k]) for k in model]  # no wait in between: ordering per key
            for h in handles + reads:
                h.wait()
            for k, v in model.items():
                assert torch.equal(outs[k].view(torch.uint8), v.view(torch.uint8)), (k, direct)
            assert sorted(s.keys()) == sorted(model) and s.nbytes(ops[-1][0]) == model[ops[-1][0]].nbytes


def test_read_after_write_sees_each_version(store):
    """Write, read, overwrite, read without waiting: each read returns the write before it."""
    a, b = torch.arange(5000.0), -torch.arange(5000.0)
    out1, out2 = torch.empty(5000), torch.empty(5000)
    handles = [store.write("x", a), store.read("x", out1), store.write("x", b), store.read("x", out2)]
    for h in handles:
        h.wait()
    assert torch.equal(out1, a) and torch.equal(out2, b)
    assert store.stats.bytes_written == 2 * a.nbytes and store.stats.bytes_read == 2 * a.nbytes


def test_bytes_in_flight_stay_capped(store, monkeypatch):
    """With many writes submitted at once, outstanding bytes never exceed the cap."""
    seen = []
    real = _fileio.OPS.pwritev

    def spy(fd, bufs, offset):
        seen.append(store._inflight_bytes)
        return real(fd, bufs, offset)

    monkeypatch.setattr(_fileio.OPS, "pwritev", spy)
    tensors = [torch.full((3000,), float(i)) for i in range(40)]  # 12 kB each, cap 64 kB
    for h in [store.write(f"t{i}", t) for i, t in enumerate(tensors)]:
        h.wait()
    assert seen and max(seen) <= store.max_inflight_bytes
    out = torch.empty(3000)
    store.read("t17", out).wait()
    assert torch.equal(out, tensors[17])


def test_scratch_files_go_on_close(tmp_path):
    s = DiskStore(tmp_path)
    s.write("a", torch.ones(10)).wait()
    assert sorted(os.listdir(s.directory)) == ["00000001.bin", "owner.json"] and "direct IO" in repr(s)
    s.close()
    assert not os.path.exists(s.directory) and os.listdir(tmp_path) == [] and "closed" in repr(s)
    with pytest.raises(RuntimeError, match="after close"):
        s.write("a", torch.ones(1))


def test_bad_use_is_named(store):
    with pytest.raises(KeyError, match="no key 'nope'"):
        store.read("nope", torch.empty(1))
    store.write("w", torch.ones(4)).wait()
    with pytest.raises(ValueError, match="holds 16 bytes.*has 12"):
        store.read("w", torch.empty(3))
    with pytest.raises(ValueError, match="contiguous CPU"):
        store.write("v", torch.ones(4, 4).t())


def test_unwritable_path_fails_at_construction(tmp_path):
    afile = tmp_path / "plain-file"
    afile.write_text("x")
    for bad in (str(afile / "store"), "/proc/parts-store"):
        with pytest.raises(PermissionError, match=f"cannot create scratch files under '{bad}'"):
            DiskStore(bad)


def test_buffered_fallback_where_direct_io_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(_fileio, "probe_direct", lambda d: False)
    with DiskStore(tmp_path) as s:
        assert not s.direct and "buffered pread/pwrite" in repr(s)
        s.write("a", torch.arange(7)).wait()
        out = torch.empty(7, dtype=torch.int64)
        s.read("a", out).wait()
        assert torch.equal(out, torch.arange(7))
    with pytest.raises(ValueError, match="refuses it"):
        DiskStore(tmp_path, direct=True)


def test_full_disk_at_reservation_names_path_and_bytes(store, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_fileio.OPS, "fallocate", full)
    with pytest.raises(DiskFullError, match=r"no space for \d+ bytes in .*parts-store-.*\.bin") as info:
        store.write("big", torch.ones(5000))
    assert info.value.nbytes >= 20000 and info.value.path.startswith(store.directory)


@pytest.mark.parametrize("mode", ["enospc", "no-progress", "short"])
def test_failing_writer(store, monkeypatch, mode):
    """A device that fails mid-write: a loud DiskFullError, a later read of the key refuses;
    one that writes short pieces: the loop completes the write."""
    real = _fileio.OPS.pwritev

    def writer(fd, bufs, offset):
        if mode == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device")
        if mode == "no-progress":
            return 0
        return real(fd, [bufs[0][:max(1, len(bufs[0]) // 3)]], offset)

    monkeypatch.setattr(_fileio.OPS, "pwritev", writer)
    store.direct = False  # short pieces are not aligned: buffered
    data = torch.randn(3000)
    handle = store.write("k", data)
    out = torch.empty(3000)
    if mode == "short":
        handle.wait()
        store.read("k", out).wait()
        assert torch.equal(out, data)
        return
    with pytest.raises(DiskFullError, match=r"no space for \d+ bytes in "):
        handle.wait()
    with pytest.raises(OSError, match="its last write failed"):
        store.read("k", out).wait()
    store.flush()  # both errors were seen by their waiters


def test_a_failing_read_names_the_key_and_the_file(store, monkeypatch):
    """An unreadable store file (EACCES from the device): the read's error keeps its kind and
    names the key and the file."""
    store.write("k", torch.randn(3000)).wait()

    def unreadable(fd, bufs, offset):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(_fileio.OPS, "preadv", unreadable)
    with pytest.raises(PermissionError, match=r"key 'k' cannot be read: parts.offload: .*parts-store-.*\.bin: "
                                              r"Permission denied"):
        store.read("k", torch.empty(3000)).wait()


_CHILD = textwrap.dedent("""
    import resource, signal, sys, torch
    from parts.offload import DiskStore, DiskFullError
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    s = DiskStore(sys.argv[1], direct=False)
    print(s.directory, flush=True)
    s.write("small", torch.ones(100)).wait()
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
    try:
        s.write("big", torch.ones(1 << 16)).wait()
    except DiskFullError as e:
        print("FULL", e.nbytes, flush=True)
    # no close(): the scratch directory must go at exit anyway
""")


@pytest.mark.slow
def test_real_file_size_limit_and_cleanup_at_exit(tmp_path):
    """A real write limit (RLIMIT_FSIZE, EFBIG) gives DiskFullError; exit removes the scratch files."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", _CHILD, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=120)
    lines = out.stdout.split()
    assert out.returncode == 0, out.stderr
    assert lines[1] == "FULL" and 0 < int(lines[2]) <= 4 << 16, out.stdout
    assert not os.path.exists(lines[0]) and os.listdir(tmp_path) == []


def test_deleted_keys_free_their_files_and_names_are_not_reused(store):
    store.write("a", torch.ones(3000)).wait()
    store.write("b", torch.full((3000,), 2.0)).wait()
    store.delete("a")
    assert "a" not in store and [n for n in os.listdir(store.directory) if n.endswith(".bin")] == ["00000002.bin"]
    store.write("c", torch.full((10,), 3.0)).wait()  # must not land in b's file
    out = torch.empty(3000)
    store.read("b", out).wait()
    assert torch.equal(out, torch.full((3000,), 2.0))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_empty_writes_between_writes_keep_the_key_in_order(tmp_path, direct):
    """An empty write between two writes of a key keeps them in order: the last write lands
    last and a read returns its bytes, not an earlier write's still in flight."""
    with DiskStore(tmp_path, threads=4, block_bytes=4096, direct=direct) as store:
        for trial in range(200):
            first, last = torch.tensor([float(trial)]), torch.tensor([-float(trial) - 1])
            handles = [store.write("k", first), store.write("k", torch.empty(0)),
                       store.write("k", torch.empty(0)), store.write("k", last)]
            out = torch.empty(1)
            handles.append(store.read("k", out))
            for handle in handles:
                handle.wait()
            assert torch.equal(out, last), (trial, out.item(), last.item())


def test_rename_commits_a_staged_key_in_order(store):
    """A write staged under one key and renamed over another (still in flight) is what the
    other key reads; the staged key is gone and the replaced bytes' file takes the next new key
    of its size (no new file), without touching the renamed key's bytes."""
    store.write("w", torch.zeros(3000)).wait()
    store.write("w~staged", torch.full((3000,), 5.0))  # not waited: the rename keeps its order
    store.rename("w~staged", "w")
    out = torch.empty(3000)
    store.read("w", out).wait()
    assert torch.equal(out, torch.full((3000,), 5.0)) and "w~staged" not in store
    store.write("w~staged", torch.full((3000,), 7.0))  # the next step's: into the spare file
    store.rename("w~staged", "w")
    store.read("w", out).wait()
    assert torch.equal(out, torch.full((3000,), 7.0))
    assert sorted(n for n in os.listdir(store.directory) if n.endswith(".bin")) == ["00000001.bin", "00000002.bin"]
    with pytest.raises(KeyError, match="no key 'nope' to rename"):
        store.rename("nope", "w")
