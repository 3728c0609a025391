"""Tests for parts.csrc: both implementations of flatten/unflatten/copy_in/copy_out."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import parts.csrc as csrc
from parts.csrc import _build, native, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SETTINGS = settings(max_examples=25, deadline=None)


@pytest.fixture(scope="module")
def impls():
    """Both implementations; the native one is built here once (left out where it cannot be)."""
    return [reference, native] if native.available() else [reference]


@pytest.fixture(scope="module")
def native_ok(impls):
    """Skip a test of the native ops themselves where they are unavailable."""
    if native not in impls:
        pytest.skip(f"native ops unavailable: {_build._STATE.get('error')}")


shape_st = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
shapes_st = st.lists(shape_st, min_size=1, max_size=6)


def _make(shapes, dtype, seed):
    """Random tensors of the given shapes (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret as integers so comparisons are bitwise."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


@SETTINGS
@given(shapes=shapes_st, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_flatten_unflatten_round_trip(impls, shapes, dtype, seed):
    ts = _make(shapes, dtype, seed)
    oracle = torch._utils._flatten_dense_tensors(ts)
    for impl in impls:
        flat = impl.flatten(ts)
        assert _bitwise_equal(flat, oracle), impl.__name__
        back = impl.unflatten(flat, ts)
        assert len(back) == len(ts)
        for i, (b, t) in enumerate(zip(back, ts)):
            assert _bitwise_equal(b, t), (impl.__name__, i)


@SETTINGS
@given(shapes=shapes_st, pad=st.integers(0, 5))
def test_unflatten_returns_views_into_flat(impls, shapes, pad):
    like = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]  # only shapes are used
    total = sum(t.numel() for t in like)
    for impl in impls:
        flat = torch.arange(total + pad, dtype=torch.float32)
        views = impl.unflatten(flat, like)
        offset = 0
        for v, t in zip(views, like):
            assert v.shape == t.shape and v.dtype == flat.dtype
            assert v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            assert v.storage_offset() == offset
            offset += t.numel()
        flat.neg_()  # writes through flat are seen by every view
        expected = -torch.arange(total, dtype=torch.float32)
        got = torch.cat([v.reshape(-1) for v in views]) if views else expected
        assert torch.equal(got, expected)


def _layout(numels, world, extra, gaps):
    """Shard sizes (ceil + extra padding), offsets with gaps, and the chunk size."""
    shard = [-(-n // world) + e for n, e in zip(numels, extra)]
    offsets, pos = [], 0
    for s, g in zip(shard, gaps):
        pos += g
        offsets.append(pos)
        pos += s
    return shard, offsets, pos + 1  # one trailing padding element per chunk


def _slice_pack(ts, world, rank, shard, offsets, chunk, fill):
    """Plain-slicing reference for rank `rank`'s send buffer."""
    buf = torch.full((chunk,), fill, dtype=ts[0].dtype)
    for t, s, o in zip(ts, shard, offsets):
        part = t.reshape(-1)[rank * s : (rank + 1) * s]
        buf[o : o + part.numel()] = part
    return buf


@SETTINGS
@given(numels=st.lists(st.integers(0, 40), min_size=1, max_size=6), world=st.integers(1, 4),
       data=st.data(), dtype=st.sampled_from(DTYPES))
def test_copy_in_copy_out_round_trip(impls, numels, world, data, dtype):
    n = len(numels)
    extra = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    gaps = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    shard, offsets, chunk = _layout(numels, world, extra, gaps)
    ts = _make([(k,) for k in numels], dtype, data.draw(st.integers(0, 2**16)))
    ts = [t.view(-1, 1) if t.numel() % 2 else t.view(2, -1) if t.numel() else t for t in ts]
    sends = []
    for r in range(world):
        expected = _slice_pack(ts, world, r, shard, offsets, chunk, fill=7.0)
        srcs = [t.reshape(-1)[r * s : (r + 1) * s] for t, s in zip(ts, shard)]
        for impl in impls:
            buf = torch.full((chunk,), 7.0, dtype=dtype)
            impl.copy_in(srcs, buf, offsets)
            assert _bitwise_equal(buf, expected), (impl.__name__, r)
        sends.append(expected)
    gathered = torch.cat(sends)
    for impl in impls:
        outs = [torch.full_like(t, float("nan")) for t in ts]
        impl.copy_out(gathered, outs, world, offsets, shard)
        for i, (o, t) in enumerate(zip(outs, ts)):
            assert _bitwise_equal(o, t), (impl.__name__, i)


def test_backends_identical_on_strided_inputs(impls, native_ok):
    base = torch.randn(6, 8)
    ts = [base.t(), base[:, ::2], torch.randn(())]  # non-contiguous inputs are read correctly
    flats = [impl.flatten(ts) for impl in impls]
    assert torch.equal(flats[0], flats[1])
    bufs = [torch.zeros(100) for _ in impls]
    for impl, buf in zip(impls, bufs):
        impl.copy_in(ts, buf, [0, 50, 99])
    assert torch.equal(bufs[0], bufs[1])


def test_flatten_autograd_matches_reference(impls, native_ok):
    grads = []
    for impl in impls:
        ts = [torch.randn(2, 3, generator=torch.Generator().manual_seed(i), requires_grad=True)
              for i in range(3)]
        (impl.flatten(ts) * torch.arange(18.0)).sum().backward()
        grads.append(torch.cat([t.grad.reshape(-1) for t in ts]))
    assert torch.equal(grads[0], torch.arange(18.0)) and torch.equal(grads[1], grads[0])


def test_native_ops_on_meta_and_fake_tensors(native_ok):
    meta = [torch.empty(3, 4, device="meta"), torch.empty(5, device="meta")]
    flat = native.flatten(meta)
    assert flat.device.type == "meta" and flat.shape == (17,)
    assert [v.shape for v in native.unflatten(flat, meta)] == [(3, 4), (5,)]
    native.copy_in(meta, torch.empty(20, device="meta"), [0, 12])
    native.copy_out(torch.empty(20, device="meta"), meta, 2, [0, 6], [6, 3])
    with FakeTensorMode():
        ts = [torch.empty(3, 4, dtype=torch.bfloat16), torch.empty(5, dtype=torch.bfloat16)]
        flat = native.flatten(ts)
        assert flat.shape == (17,) and flat.dtype == torch.bfloat16
        assert [v.shape for v in native.unflatten(flat, ts)] == [(3, 4), (5,)]
        native.copy_out(torch.empty(20, dtype=torch.bfloat16), ts, 2, [0, 6], [6, 3])


def test_opcheck_native_ops(native_ok):
    a, b = torch.randn(3, 4), torch.randn(5)
    cases = [
        (torch.ops.parts.flatten.default, ([a, b],)),
        (torch.ops.parts.copy_in.default, ([a, b], torch.zeros(20), [0, 12])),
        (torch.ops.parts.copy_out.default, (torch.randn(20), [a.clone(), b.clone()], 2, [0, 6], [6, 3])),
        (torch.ops.parts.unflatten.default, (torch.randn(20), [12, 5], [2, 3, 4, 1, 5])),
    ]
    for op, args in cases:
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, (op, result)


BAD = [
    ("flatten", lambda m: m.flatten([]), "empty"),
    ("flatten", lambda m: m.flatten([torch.ones(2), torch.ones(2, dtype=torch.float16)]), r"tensors\[1\]"),
    ("unflatten", lambda m: m.unflatten(torch.ones(3), [torch.ones(2, 2)]), "needs 4"),
    ("unflatten", lambda m: m.unflatten(torch.ones(2, 2), [torch.ones(2)]), "1-D"),
    ("copy_in", lambda m: m.copy_in([torch.ones(2)], torch.ones(4), [0, 1]), "len"),
    ("copy_in", lambda m: m.copy_in([torch.ones(2), torch.ones(3)], torch.ones(4), [0, 2]), r"srcs\[1\]"),
    ("copy_in", lambda m: m.copy_in([torch.ones(2)], torch.ones(4), [-1]), r"offsets\[0\]"),
    ("copy_in", lambda m: m.copy_in([torch.ones(2, dtype=torch.bfloat16)], torch.ones(4), [0]), "dtype"),
    ("copy_out", lambda m: m.copy_out(torch.ones(5), [torch.ones(2)], 2, [0], [1]), "divisible"),
    ("copy_out", lambda m: m.copy_out(torch.ones(6), [torch.ones(2)], 2, [2], [2]), r"offsets\[0\]"),
    ("copy_out", lambda m: m.copy_out(torch.ones(6), [torch.ones(5)], 2, [0], [2]), r"dsts\[0\]"),
    ("copy_out", lambda m: m.copy_out(torch.ones(6), [torch.ones(2), torch.ones(1)], 2, [0], [1]), "len"),
    ("copy_out", lambda m: m.copy_out(torch.ones(6), [torch.ones(4, 2).t()], 1, [0], [6]), "contiguous"),
]


@pytest.mark.parametrize("op,call,match", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_raises_naming_the_index(impls, op, call, match):
    for impl in impls:
        with pytest.raises(ValueError, match=match):
            call(impl)


def test_default_dispatch_matches_reference(impls):
    ts = _make([(3, 4), (), (0,), (7,)], torch.float32, 0)
    assert torch.equal(csrc.flatten(ts), reference.flatten(ts))
    assert all(torch.equal(a, b) for a, b in zip(csrc.unflatten(csrc.flatten(ts), ts), ts))
    parts = dict(kv.split("=") for kv in csrc.backend().split(","))
    assert set(parts) == {"flatten", "unflatten", "copy_in", "copy_out"}
    forced = csrc._forced_fallback()
    for op, use in csrc.NATIVE_DEFAULT.items():
        assert parts[op] == ("native" if use and not forced else "torch")


def test_fallback_warns_exactly_once(monkeypatch):
    monkeypatch.delenv("PARTS_CSRC_FALLBACK", raising=False)
    monkeypatch.setattr(csrc, "NATIVE_DEFAULT", dict.fromkeys(csrc.NATIVE_DEFAULT, True))
    monkeypatch.setattr(csrc, "_warned", False)
    monkeypatch.setattr(_build, "_STATE", {"ok": False, "error": "simulated: no compiler"})
    ts = [torch.ones(2), torch.zeros(3)]
    with pytest.warns(csrc.NativeFallbackWarning, match="simulated") as record:
        flat = csrc.flatten(ts)
        csrc.copy_in(ts, torch.empty(5), [0, 2])
        csrc.unflatten(flat, ts)
    assert len(record) == 1
    assert torch.equal(flat, torch.tensor([1.0, 1, 0, 0, 0]))
    assert csrc.backend() == "flatten=torch,unflatten=torch,copy_in=torch,copy_out=torch"


def test_env_forces_torch_without_warning(monkeypatch):
    monkeypatch.setenv("PARTS_CSRC_FALLBACK", "1")
    monkeypatch.setattr(csrc, "NATIVE_DEFAULT", dict.fromkeys(csrc.NATIVE_DEFAULT, True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(csrc.flatten([torch.ones(2)]), torch.ones(2))
    assert "native" not in csrc.backend()


def test_build_without_compiler_is_unavailable(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.delenv("PARTS_CSRC_FALLBACK", raising=False)
    with pytest.raises(_build.NativeUnavailable, match="compiler"):
        _build._compile()
