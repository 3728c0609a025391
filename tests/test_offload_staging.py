"""Staging between host and accelerator (parts.offload.staging): on a CPU-only machine it does
nothing; with a simulated accelerator whose copies run only when their event is waited, no host
memory is read, written to disk, reused or freed before its copy is done, and offloaded training
stays bitwise equal to training in memory."""

import math
import threading

import pytest
import torch
import torch.distributed as dist

from harness import run
from test_offload_backward_step import OPTIMIZERS
from test_offload_partition import KNOBS, _build, _train
from parts.offload import DiskStore, OffloadedOptimizer, landing, parking
from parts.offload.staging import DeviceStreams, Staging, staging
from parts.partition import MixedPrecision, attach, detach, full_state_dict, shards


class FakeEvent:
    """An event of a simulated stream: done once the stream ran up to it."""

    def __init__(self, streams):
        self.streams, self.ran, self.waits = streams, False, 0

    def query(self):
        return self.ran

    def synchronize(self):
        self.waits += 1
        self.streams.run_until(self)


class FakeStreams:
    """A simulated accelerator (CPU tensors stand for device ones): a copy runs only when its event,
    or a later one, is waited; its output holds NaN until then, so a read before the wait shows."""

    def __init__(self, defer_h2d=False):
        self.queue, self.defer_h2d, self.copies = [], defer_h2d, {"h2d": 0, "d2h": 0}
        self.lock = threading.RLock()

    def accelerated(self, device):
        return True

    def pins(self):
        return False

    def host_empty(self, numel, dtype):
        if dtype.is_floating_point:
            return torch.full((numel,), math.nan, dtype=dtype)
        return torch.empty(numel, dtype=dtype)

    def _enqueue(self, fn):
        event = FakeEvent(self)
        with self.lock:
            self.queue.append((event, fn))
        return event

    def run_until(self, event):
        with self.lock:
            while not event.ran and self.queue:
                first, fn = self.queue.pop(0)
                fn()
                first.ran = True

    def h2d(self, src, device, dtype):
        self.copies["h2d"] += 1
        out = self.host_empty(src.numel(), dtype).view(src.shape)
        event = self._enqueue(lambda: out.copy_(src))
        if not self.defer_h2d:  # the compute stream waits for it before the all-gather reads ``out``
            self.run_until(event)
        return out, event

    def d2h(self, src, out):
        self.copies["d2h"] += 1
        if out.is_floating_point():
            out.fill_(math.nan)  # the copy may land any time from now on
        return self._enqueue(lambda: out.copy_(src))


def test_cpu_staging_is_a_plain_copy():
    streams = DeviceStreams()
    assert not streams.pins() and not streams.accelerated(torch.device("cpu"))
    assert not streams.host_empty(8, torch.float32).is_pinned()
    src = torch.randn(6, dtype=torch.float64)
    out = Staging(streams).to_device(src, torch.device("cpu"), torch.float32)
    assert torch.equal(out, src.to(torch.float32)) and not staging.wants_host(src)
    same = Staging(streams).to_device(src, torch.device("cpu"), torch.float64)
    assert same is src and staging.fence(src) is None


def test_copy_to_host_is_fenced_until_waited_through_any_view():
    stage = Staging(FakeStreams())
    src = torch.arange(12, dtype=torch.float32)
    out = stage.to_host(src, stage.host_empty(12, torch.float32))
    assert torch.isnan(out).all()  # not yet copied
    fence = stage.fence(out[4:])
    assert fence is not None and not fence.done
    stage.wait(out[2:5])
    assert torch.equal(out, src) and stage.fence(out) is None


def test_store_writes_a_staged_grad_only_after_its_copy(tmp_path):
    fake = FakeStreams()
    real = staging.streams
    staging.streams = fake
    store = DiskStore(str(tmp_path), block_bytes=4096)
    try:
        src = torch.randn(5000)
        out = staging.to_host(src, staging.host_empty(5000, torch.float32))
        store.write("g", out).wait()  # the IO thread waits for the copy before reading the memory
        back = torch.empty(5000)
        store.read("g", back).wait()
        assert torch.equal(back, src) and fake.queue == []
    finally:
        staging.streams = real
        store.close()


def test_parked_memory_goes_back_to_the_pool_only_after_its_copy_to_the_device(tmp_path):
    fake = FakeStreams(defer_h2d=True)
    real = staging.streams
    staging.streams = fake
    store = DiskStore(str(tmp_path), block_bytes=4096)
    try:
        t = torch.randn(20_000)
        parking.park(t, store, "w")
        parking.load(t)
        sent = staging.to_device(t, torch.device("cpu"), torch.float32)
        seen = []
        give = store.reuse.give
        store.reuse.give = lambda storage: (seen.append(not fake.queue), give(storage))
        parking.drop(t)
        assert seen == [True]  # the copy reading the memory had finished before the pool got it
        stored = torch.empty(20_000)
        store.read("w", stored).wait()
        assert torch.equal(sent, stored)
        buf = landing.grad_buffer(t, 20_000, torch.float32, staging.host_empty)
        staging.to_host(torch.ones(20_000), buf)
        landing.give_back(buf)
        assert fake.queue == []  # give_back waited for the copy filling the block
    finally:
        store.reuse.give = give
        staging.streams = real
        store.close()


def test_a_step_waits_for_the_copy_still_reading_its_parameter():
    fake = FakeStreams(defer_h2d=True)
    real = staging.streams
    staging.streams = fake
    try:
        w = torch.randn(100)
        before = w.clone()
        sent = staging.to_device(w, torch.device("cpu"), torch.float32)  # reads w, runs late
        w.grad = torch.ones(100)
        torch.optim.SGD([w], lr=0.5).step()  # in place: only once the copy has read w
        assert torch.equal(sent, before) and not torch.equal(w, before)
    finally:
        staging.streams = real


def body_offload_with_device_compute(tmp, in_backward):
    """Shards and optimizer state on disk, compute (bf16 gathers) on a simulated accelerator whose
    copies run late: bitwise the in-memory run, every landed grad staged to the host, every shard
    sent through the copy stream, every copy waited."""
    knobs = dict(KNOBS, mixed_precision=MixedPrecision())
    fake = FakeStreams()
    real = staging.streams
    rank = dist.get_rank()
    ref = _build(None)
    store = DiskStore(f"{tmp}/r{rank}", block_bytes=4096, max_inflight_bytes=1 << 16)
    try:
        ref_losses = _train(attach(ref, **knobs) and ref, OPTIMIZERS["adamw"](shards(ref)), 4, rank)
        staging.streams = fake
        off = _build(store)
        attach(off, **knobs)
        opt = OffloadedOptimizer(OPTIMIZERS["adamw"](shards(off)), store, chunk_bytes=20_000)
        off_losses = _train(off, opt, 4, rank, in_backward=in_backward)
        opt.settle()
        sd_ref, sd_off = full_state_dict(ref), full_state_dict(off)
        out = dict(same_losses=all(torch.equal(a, b) for a, b in zip(ref_losses, off_losses)),
                   same_params=all(torch.equal(sd_ref[k], sd_off[k]) for k in sd_ref),
                   copies=dict(fake.copies), left=len(fake.queue))
        detach(off)
    finally:
        staging.streams = real
        detach(ref)
        store.close()
    return out


@pytest.mark.slow
def test_offload_with_device_compute_equals_memory(tmp_path):
    for in_backward in (False, True):
        for out in run(2, body_offload_with_device_compute, str(tmp_path / str(in_backward)), in_backward):
            assert out["same_losses"] and out["same_params"], out
            assert out["copies"]["d2h"] > 0 and out["copies"]["h2d"] > 0 and out["left"] == 0, out
