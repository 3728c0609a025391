"""OffloadedOptimizer.step_in_backward: each parameter stepped as its grad lands, bitwise the in-memory run.

The landed grads never go to the store (only the grads of micro-batches before the last, outside
the context, do); reads started ahead along the last landing order are used or dropped; a slow
writer shows no buffer is freed or reused while its write is in flight.
"""

import contextlib
import math

import pytest
import torch
import torch.distributed as dist

from harness import run
from test_coordinator_models import batch
from test_offload_bf16 import _build as _build_bf16
from test_offload_partition import KNOBS, _build, _train
from test_offload_pipeline import _slow_writes
from parts.offload import DiskStore, OffloadedOptimizer, _fileio, parking
from parts.offload.backward_step import BackwardStep
from parts.optim import BF16Optimizer
from parts.partition import attach, detach, full_state_dict, meta, shards
from parts.partition.core import disk

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-2),
}


def shard_tensors(model):
    """The shard tensors themselves (``shards()`` gives optimizer leaves, which may be views of them)."""
    return [meta(p).shard for p in model.parameters()]


def _grad_writes(store, counted):
    """Count the store's writes of grad keys into ``counted`` (a list) from now on."""
    real = store.write

    def write(key, tensor):
        if key.endswith("/grad"):
            counted.append(key)
        return real(key, tensor)

    store.write = write


def _shard_reads(store, opt, counted):
    """Count the store's reads of shard keys into ``counted``: {steps taken so far: {key: reads}}."""
    real_read, real_step = store.read, opt.step
    steps = [0]

    def read(key, out, urgent=False):
        if key.startswith("shard/"):
            per_step = counted.setdefault(steps[0], {})
            per_step[key] = per_step.get(key, 0) + 1
        return real_read(key, out, urgent)

    def step(*args, **kwargs):
        steps[0] += 1
        return real_step(*args, **kwargs)

    store.read, opt.step = read, step


@contextlib.contextmanager
def _replaced(owner, name, replacement):
    """``owner.<name>`` is ``replacement`` inside (None: unchanged); restored after, since the
    harness workers outlive the test."""
    real = getattr(owner, name)
    if replacement is not None:
        setattr(owner, name, replacement(real))
    try:
        yield
    finally:
        setattr(owner, name, real)


def body_equivalence(tmp, kind, slow, knobs=KNOBS, keep=True):
    # without keep, shards loaded for backward's all-gathers are dropped, and read again for their steps
    with _replaced(BackwardStep, "keeps", None if keep else lambda real: lambda self, i: False):
        return _equivalence(tmp, kind, slow, knobs)


def _equivalence(tmp, kind, slow, knobs):
    rank = dist.get_rank()
    ref = _build(None)
    store = DiskStore(f"{tmp}/r{rank}", block_bytes=4096, max_inflight_bytes=1 << 16,
                      direct=False if slow else None)
    off = _build(store)
    attach(ref, **knobs), attach(off, **knobs)
    ref_opt = OPTIMIZERS[kind](shards(ref))
    off_opt = OffloadedOptimizer(OPTIMIZERS[kind](shards(off)), store, chunk_bytes=20_000)
    grad_keys, real, slept, torn, reads = [], _fileio.OPS.pwritev, [], [], {}
    _grad_writes(store, grad_keys)
    _shard_reads(store, off_opt, reads)
    if slow:
        _slow_writes(store, slept, torn)
    try:
        ref_losses = _train(ref, ref_opt, 4, rank)
        off_losses = _train(off, off_opt, 4, rank, in_backward=True)
        held_after_step = sum(parking.parked(p).holds for p in shard_tensors(off))
        off_opt.settle()
    finally:
        _fileio.OPS.pwritev = real
    sd_ref, sd_off = full_state_dict(ref), full_state_dict(off)
    out = dict(
        same_losses=all(torch.equal(a, b) for a, b in zip(ref_losses, off_losses)),
        same_params=all(torch.equal(sd_ref[k], sd_off[k]) for k in sd_ref),
        same_state=_same_state(ref_opt, off_opt),
        landed=len(off_opt.backward_step.order), params=len(shards(off)),
        grad_writes=len(set(grad_keys)), held_after_step=held_after_step,
        held_after_settle=sum(parking.parked(p).holds for p in shard_tensors(off)),
        resident=sum(1 for p in shard_tensors(off) if p.untyped_storage().nbytes()),
        last_step_reads=reads[3], shard_keys=len(shards(off)),
        slept=len(slept), torn=torn)
    detach(ref), detach(off)
    store.close()
    return out


def _same_state(ref_opt, off_opt) -> bool:
    ref, off = ref_opt.state_dict()["state"], off_opt.state_dict()["state"]
    return sorted(ref) == sorted(off) and all(torch.equal(torch.as_tensor(v), torch.as_tensor(off[i][k]))
                                              for i, st in ref.items() for k, v in st.items())


def _check(out, slow=False):
    assert out["same_losses"] and out["same_params"] and out["same_state"]
    assert out["landed"] == out["params"]  # every parked shard's grad landed inside the context
    # only the first micro-batch of the accumulating step (outside the context) stores grads: all
    # of them; the landed ones went to the step, not to the store
    assert out["grad_writes"] == out["params"]
    assert out["held_after_step"] > 0  # the next backward's first shards, read ahead
    assert out["held_after_settle"] == 0 and out["resident"] == 0
    if slow:
        assert out["slept"] > 0 and out["torn"] == []


@pytest.mark.parametrize("world", [1, 2])
def test_step_in_backward_equals_memory(tmp_path, world):
    for out in run(world, body_equivalence, str(tmp_path), "adamw", False):
        _check(out)


@pytest.mark.parametrize("world", [2, 3])
def test_step_in_backward_reuses_the_backward_gathers_bytes(tmp_path, world):
    """Grads landing a block at a time (a reduce bucket of about one block): a shard loaded for
    its backward all-gather stays loaded for its step, which then reads only its state. A steady
    step reads each shard about twice (its forward and backward all-gathers; the tied embedding,
    gathered twice in forward, and a shard landing late read three times) where more shards are
    read three times with the shards dropped after the gathers; bitwise the in-memory run either way."""
    knobs = dict(KNOBS, reduce_bucket_size=3000)
    kept = run(world, body_equivalence, str(tmp_path / "kept"), "adamw", False, knobs)
    dropped = run(world, body_equivalence, str(tmp_path / "dropped"), "adamw", False, knobs, False)
    for out in kept + dropped:
        _check(out)
    for k, d in zip(kept, dropped):
        thrice = [sum(n == 3 for n in out["last_step_reads"].values()) for out in (k, d)]
        assert max(k["last_step_reads"].values()) <= 3 and thrice[0] < thrice[1], thrice


def body_boundary_reads(tmp, want):
    """Shard reads per key in a steady step of plain offloaded training (the last step of four)."""
    # without want, the last forward layers' shards are dropped after their gathers and read again
    with _replaced(parking, "want", None if want else lambda real: lambda t: None):
        return _boundary_reads(tmp)


def _boundary_reads(tmp):
    rank = dist.get_rank()
    ref, store = _build(None), DiskStore(f"{tmp}/r{rank}", block_bytes=4096)
    off = _build(store)
    attach(ref, **KNOBS), attach(off, **KNOBS)
    ref_opt = torch.optim.AdamW(shards(ref), lr=1e-2)
    off_opt = OffloadedOptimizer(torch.optim.AdamW(shards(off), lr=1e-2), store, chunk_bytes=20_000)
    reads = {}
    _shard_reads(store, off_opt, reads)
    same = all(torch.equal(a, b) for a, b in zip(_train(ref, ref_opt, 4, rank), _train(off, off_opt, 4, rank)))
    detach(ref), detach(off)
    store.close()
    order = [parking.parked(p).key for p in shard_tensors(off)]  # keys differ between runs: compare by place
    return dict(same=same, reads=[reads[3].get(key, 0) for key in order])


@pytest.mark.parametrize("world", [1, 2])
def test_last_forward_shards_stay_loaded_into_backward(tmp_path, world):
    """A shard used at the end of forward and again at the start of backward, both within the
    coordinator's read-ahead window, is read once for both (``parking.want``), not dropped after
    its forward all-gather and read again; no shard is read more often; bitwise the in-memory run."""
    wanted = run(world, body_boundary_reads, str(tmp_path / "want"), True)
    dropped = run(world, body_boundary_reads, str(tmp_path / "drop"), False)
    for w, d in zip(wanted, dropped):
        assert w["same"] and d["same"]
        pairs = list(zip(w["reads"], d["reads"]))
        assert all(a <= b for a, b in pairs) and any(a < b for a, b in pairs), pairs


def body_loaded_after_forward(tmp, marks_ignore_reuse):
    """Shard bytes left loaded at the end of each forward of plain offloaded training in which
    parameters stay gathered between uses (``max_reuse_distance``): the tied embedding, used
    first and last in forward, is gathered once and kept; and whether losses match in memory."""
    def ignoring_reuse(real):  # marks every shard used twice in the window, kept gathered or not
        return lambda *args, max_reuse_distance=0: real(*args, max_reuse_distance=0)

    with _replaced(disk, "read_ahead", ignoring_reuse if marks_ignore_reuse else None):
        return _loaded_after_forward(tmp)


def _loaded_after_forward(tmp):
    rank = dist.get_rank()
    knobs = dict(KNOBS, prefetch_bucket_size=100_000, max_live_parameters=200_000, max_reuse_distance=10**9)
    ref, store = _build(None), DiskStore(f"{tmp}/r{rank}", block_bytes=4096)
    off = _build(store)
    attach(ref, **knobs), attach(off, **knobs)
    ref_opt = torch.optim.AdamW(shards(ref), lr=1e-2)
    off_opt = OffloadedOptimizer(torch.optim.AdamW(shards(off), lr=1e-2), store, chunk_bytes=20_000)
    loaded, same = [], True
    for step in range(4):  # each loss after the first checks the step before
        losses = [model(*batch(step, 4, 8 * rank)) for model in (ref, off)]
        loaded.append(sum(p.numel() * p.element_size() for p in shard_tensors(off)
                          if parking.parked(p) is not None and parking.parked(p).resident))
        same &= torch.equal(losses[0], losses[1])
        for loss, opt in zip(losses, (ref_opt, off_opt)):
            loss.backward()
            opt.step()
            opt.zero_grad()
    detach(ref), detach(off)
    store.close()
    return dict(loaded=loaded, same=same)


@pytest.mark.parametrize("world", [1, 2])
def test_a_shard_kept_gathered_between_its_uses_is_not_kept_loaded(tmp_path, world):
    """A shard used twice within the read-ahead window stays loaded between the uses only if its
    parameter is released between them: one kept gathered (within ``max_reuse_distance``) is
    not all-gathered again, so loaded bytes would only sit there. With the marks ignoring reuse,
    the tied embedding's shard stays loaded to the end of forward; bitwise the in-memory run."""
    fixed = run(world, body_loaded_after_forward, str(tmp_path / "fixed"), False)
    stale = run(world, body_loaded_after_forward, str(tmp_path / "stale"), True)
    for f, s in zip(fixed, stale):
        assert f["same"] and s["same"]
        pairs = list(zip(f["loaded"], s["loaded"]))[1:]  # the first step records the trace
        assert all(a < b for a, b in pairs), pairs


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_step_in_backward_other_optimizers(tmp_path, kind):
    for out in run(2, body_equivalence, str(tmp_path), kind, False):
        _check(out)


@pytest.mark.slow
def test_step_in_backward_slow_writer(tmp_path):
    for out in run(2, body_equivalence, str(tmp_path), "adamw", True):
        _check(out, slow=True)


def body_refusals(tmp):
    rank = dist.get_rank()
    store = DiskStore(f"{tmp}/r{rank}", block_bytes=4096)
    model = _build(store)
    attach(model, **KNOBS)
    opt = OffloadedOptimizer(torch.optim.AdamW(shards(model), lr=1e-2), store, chunk_bytes=20_000)
    errors = []
    with opt.step_in_backward():
        model(*batch(0, 4, 8 * rank)).backward()
        try:
            model(*batch(1, 4, 8 * rank)).backward()  # a second backward before step()
        except RuntimeError as e:
            errors.append(str(e))
    try:
        opt.settle()  # grads landed and not stepped
    except RuntimeError as e:
        errors.append(str(e))
    detach(model)
    store.close()
    return errors


def test_step_in_backward_refusals(tmp_path):
    errors = run(1, body_refusals, str(tmp_path))[0]
    assert len(errors) == 2
    assert "landed twice before step()" in errors[0]
    assert "call step() (or zero_grad() to discard them) first" in errors[1]


def body_bf16_refused(tmp):
    rank = dist.get_rank()
    store = DiskStore(f"{tmp}/r{rank}", block_bytes=4096)
    model = _build_bf16(store)
    attach(model, **KNOBS)
    inner = OffloadedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), store, chunk_bytes=6000)
    opt = BF16Optimizer(inner, clip_grad=0.05)
    try:
        with inner.step_in_backward():
            pass
        message = "no error"
    except RuntimeError as e:
        message = str(e)
    model(*batch(0, 4, 8 * rank)).backward()  # the refusal left nothing behind: a normal step works
    opt.step()
    detach(model)
    store.close()
    return message, math.isfinite(opt.last_grad_norm)


def test_step_in_backward_refuses_bf16_masters(tmp_path):
    message, stepped = run(1, body_bf16_refused, str(tmp_path))[0]
    assert "BF16Optimizer master" in message and "key 'master/" in message, message
    assert stepped
