"""parts.checkpoint's RNG handling in one process: the CPU and tracked streams after backward
equal those before, a tracker's stream replayed bitwise, and RNGTracker's own rules."""

from __future__ import annotations

import pytest
import torch

from parts.checkpoint import CheckpointPolicy, RNGTracker, checkpoint, seed_model_parallel
from test_checkpoint import MLP, assert_all_equal
from test_checkpoint import _one_thread  # noqa: F401 - the same autouse fixture here


def test_rng_states_after_backward_equal_before():
    tracker = seed_model_parallel(11)
    policy = CheckpointPolicy(rng_tracker=tracker)
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(5, 11, requires_grad=True)
    start = torch.get_rng_state()

    def body(h):
        with tracker.fork():
            h = model(h)
        return model(h)

    out = checkpoint(body, x * 1.0, policy=policy)
    cpu_before, tracked_before = torch.get_rng_state(), tracker.get_states()
    assert not torch.equal(cpu_before, start)  # forward drew random numbers
    out.sum().backward()
    assert torch.equal(torch.get_rng_state(), cpu_before)
    after = tracker.get_states()
    assert after.keys() == tracked_before.keys()
    assert all(torch.equal(after[k], tracked_before[k]) for k in after)


def _tracked_mlp():
    """A seeded tracker, an MLP, an input, and a body that runs the MLP in the tracker's stream."""
    tracker = seed_model_parallel(5)
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(5, 11, requires_grad=True)

    def body(h):
        with tracker.fork():
            return model(h)

    return tracker, model, x, body


def test_tracker_stream_replayed_bitwise():
    def run(ckpt):
        tracker, model, x, body = _tracked_mlp()
        h = x * 1.0
        for _ in range(3):
            h = checkpoint(body, h, policy=CheckpointPolicy(rng_tracker=tracker)) if ckpt else body(h)
        h.sum().backward()
        return [x.grad] + [p.grad for p in model.parameters()]

    assert_all_equal(run(False), run(True))


def test_without_tracker_in_policy_tracked_dropout_diverges():
    # the tracker must be passed: otherwise its stream is not replayed (documented)
    tracker, model, x, body = _tracked_mlp()
    ref = torch.autograd.grad(body(x * 1.0).sum(), [x])[0]
    tracker = seed_model_parallel(5, tracker=tracker)
    got = torch.autograd.grad(checkpoint(body, x * 1.0).sum(), [x])[0]
    assert not torch.equal(ref, got)


def test_rng_tracker_basics():
    tracker = RNGTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 for 'b' is already used by 'a'"):
        tracker.add("b", 1)
    with pytest.raises(KeyError, match="no stream named 'zz'"):
        with tracker.fork("zz"):
            pass
    outer = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(3)
        with pytest.raises(RuntimeError, match="already forked"):
            with tracker.fork("a"):
                pass
    assert torch.equal(torch.get_rng_state(), outer)
    assert torch.equal(first, torch.rand(3, generator=torch.Generator().manual_seed(1)))
    saved = tracker.get_states()
    with tracker.fork("a"):
        second = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), second)
    assert not torch.equal(first, second)
