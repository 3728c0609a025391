"""OffloadedOptimizer steps plain Adam/AdamW in place: bitwise torch's step, no per-step temporaries."""

from __future__ import annotations

import mmap
import resource

import pytest
import torch

from parts.offload import DiskStore, OffloadedOptimizer, _adam

CONFIGS = [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, amsgrad=True)),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05)),  # coupled decay: grad + wd * param
    (torch.optim.Adam, dict(lr=1e-2, maximize=True)),
]


def _train(make, kwargs, store, steps=4, shapes=((300, 700), (700,), (64, 64))):
    """Parameters after ``steps`` steps of ``make(**kwargs)`` (offloaded if ``store``), and the optimizer."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
    opt = make(params, **kwargs)
    if store is not None:
        opt = OffloadedOptimizer(opt, store, across_steps=False)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in params], opt


@pytest.mark.parametrize("slice_bytes", [None, 4096])
@pytest.mark.parametrize("make,kwargs", CONFIGS)
def test_inplace_adam_equals_torch_bitwise(tmp_path, monkeypatch, make, kwargs, slice_bytes):
    """Bitwise torch's step, the denominator whole or a slice at a time (4096 bytes: the
    300 x 700 parameter in 206 slices, the last one partial)."""
    if slice_bytes is not None:
        monkeypatch.setattr(_adam, "SLICE_BYTES", slice_bytes)
    expected, _ = _train(make, kwargs, None)
    with DiskStore(str(tmp_path)) as store:
        got, opt = _train(make, kwargs, store)
        assert opt.inplace.steps > 0  # the in-place path ran (all but the first step)
        assert opt.inplace.held_bytes <= _adam.SLICE_BYTES
        state = opt.state_of(opt.params[0])
    for e, g in zip(expected, got):
        assert torch.equal(e, g)
    assert float(state["step"]) == 4.0


def test_inplace_adam_skips_a_hooked_optimizer(tmp_path):
    params = [torch.randn(4, 4, requires_grad=True)]
    inner = torch.optim.AdamW(params, lr=1e-2)
    calls = []
    inner.register_step_post_hook(lambda *a: calls.append(1))
    with DiskStore(str(tmp_path)) as store:
        opt = OffloadedOptimizer(inner, store, across_steps=False)
        for _ in range(2):
            params[0].grad = torch.ones(4, 4)
            opt.step()
    assert opt.inplace.steps == 0 and len(calls) == 2  # torch's step ran, its hook too


def test_inplace_adam_step_faults_no_fresh_pages(tmp_path):
    """A steady-state step of a 4 MiB parameter touches no fresh pages for its update: the
    denominator lives in the reused scratch (torch's own step takes two 4 MiB temporaries,
    fresh pages wherever the heap maps them anew). The control: writing a fresh 4 MiB mapping
    faults about 1024 times on the same counter."""
    p = torch.randn(1 << 20, requires_grad=True)
    inner = torch.optim.AdamW([p], lr=1e-3)
    for _ in range(2):
        p.grad = torch.ones_like(p)
        inner.step()
    # the same update through the in-place path, state and grad already in memory
    with DiskStore(str(tmp_path)) as store:
        opt = OffloadedOptimizer(torch.optim.AdamW([p], lr=1e-3), store, across_steps=False)
        opt.optimizer.load_state_dict(inner.state_dict())
        opt.inplace.step(opt.optimizer)  # grows the scratch once
        faults = _faults(lambda: opt.inplace.step(opt.optimizer))
    fresh = mmap.mmap(-1, 4 << 20)
    control = _faults(lambda: fresh.write(b"\1" * (4 << 20)))
    fresh.close()
    assert faults < 100 < 1000 < control, (faults, control)


def _faults(fn) -> int:
    """Minor page faults ``fn`` takes on this thread, its ops on this thread alone (other threads
    of the test process, an IO thread or a lingering one, fault at their own pace)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        fn()
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    finally:
        torch.set_num_threads(threads)
