"""Shards on disk under faults, at world 2: norms see every grad, a step during backward is a
transaction, the store's bookkeeping stays bounded, scratch space is owned and reclaimed.

References: the same model in memory on the same seeds. Norms and weights compare bitwise
(the same grad bits are reduced in the same order wherever they live).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from harness import run
from test_coordinator_models import batch
from test_offload_partition import KNOBS, _build
from parts.offload import DiskStore, OffloadedOptimizer, parking
from parts.offload._ioqueue import Op
from parts.partition import attach, clip_grad_norm_, detach, full_state_dict, grad_norm, meta, shards

FAST = 90.0  # seconds: a regression that hangs fails here


def shard_tensors(model):
    """The shard tensors themselves (``shards()`` gives optimizer leaves, which may be views of them)."""
    return [meta(p).shard for p in model.parameters()]


def _pair(tmp: str):
    """A model in memory and the same model on disk, attached, each with its AdamW."""
    rank = dist.get_rank()
    ref, store = _build(None), DiskStore(f"{tmp}/r{rank}", block_bytes=4096, max_inflight_bytes=1 << 16)
    off = _build(store)
    attach(ref, **KNOBS), attach(off, **KNOBS)
    ref_opt = torch.optim.AdamW(shards(ref), lr=1e-2)
    off_opt = OffloadedOptimizer(torch.optim.AdamW(shards(off), lr=1e-2), store, chunk_bytes=20_000)
    return ref, ref_opt, off, off_opt, store


def _same_weights(a, b) -> bool:
    sa, sb = full_state_dict(a), full_state_dict(b)
    return sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def _close(*models_and_store) -> None:
    *models, store = models_and_store
    for m in models:
        detach(m)
    store.close()


def _step(model, opt, step: int, in_backward: bool = False, hook=None) -> torch.Tensor:
    """One step of 4 rows per rank (``hook``: a forward hook on block 1 during it)."""
    handle = None if hook is None else model.blocks[1].register_forward_hook(hook)
    try:
        loss = model(*batch(step, 4, 8 * dist.get_rank()))
        with opt.step_in_backward(norm_types=(math.inf,)) if in_backward else contextlib.nullcontext():
            loss.backward()
    finally:
        if handle is not None:
            handle.remove()
    return loss.detach()


# ----------------------------------------------------------------------------- norms
def body_norms(tmp: str, in_backward: bool):
    ref, ref_opt, off, off_opt, store = _pair(tmp)
    _step(ref, ref_opt, 0)
    _step(off, off_opt, 0, in_backward)
    out = {"ref": float(grad_norm(ref)), "off": float(grad_norm(off)),
           "ref_inf": float(grad_norm(ref, math.inf)), "off_inf": float(grad_norm(off, math.inf))}
    if in_backward:  # stepped already: the norm is reported, a clip that would scale raises
        out["no_clip"] = float(clip_grad_norm_(off, 1e9))
        try:
            clip_grad_norm_(off, 0.01)
            out["error"] = "no error"
        except RuntimeError as e:
            out["error"] = str(e)
    else:
        out["clipped_ref"] = float(clip_grad_norm_(ref, 0.5))
        out["clipped_off"] = float(clip_grad_norm_(off, 0.5))
        out["after_ref"], out["after_off"] = float(grad_norm(ref)), float(grad_norm(off))
        ref_opt.step()
    off_opt.step()
    if in_backward:
        ref_opt.step()
    out["same_weights"] = _same_weights(ref, off)
    _close(ref, off, store)
    return out


def body_norm_orders(tmp: str):
    """A step during backward keeps the order-2 norm of each grad it consumes unless asked for more."""
    ref, ref_opt, off, off_opt, store = _pair(tmp)
    errors = []
    try:
        off_opt.step_in_backward(norm_types=(0,))
    except ValueError as e:
        errors.append(str(e))
    _step(ref, ref_opt, 0)
    loss = off(*batch(0, 4, 8 * dist.get_rank()))
    with off_opt.step_in_backward():
        loss.backward()
    same = float(grad_norm(off)) == float(grad_norm(ref))
    try:
        grad_norm(off, 1.0)
    except ValueError as e:
        errors.append(str(e))
    off_opt.step()
    ref_opt.step()
    _close(ref, off, store)
    return same, errors


def test_step_in_backward_keeps_the_norm_orders_asked_for(tmp_path):
    for same, errors in run(2, body_norm_orders, str(tmp_path), timeout=FAST):
        assert same and len(errors) == 2, errors
        assert "norm_types must be positive" in errors[0]
        assert "norm_types=(2.0, 1.0)" in errors[1] and "orders [2.0] only" in errors[1], errors[1]


def test_clip_grad_norm_sees_grad_shards_on_disk(tmp_path):
    for out in run(2, body_norms, str(tmp_path), False, timeout=FAST):
        assert out["ref"] > 0.5 and out["off"] == out["ref"] and out["off_inf"] == out["ref_inf"]
        assert out["clipped_off"] == out["clipped_ref"] == out["ref"]
        assert out["after_off"] == out["after_ref"] and out["after_ref"] < 0.5 + 1e-5
        assert out["same_weights"]


def test_grad_norm_sees_grads_stepped_during_backward(tmp_path):
    for out in run(2, body_norms, str(tmp_path), True, timeout=FAST):
        assert out["ref"] > 0.01 and out["off"] == out["ref"] and out["off_inf"] == out["ref_inf"]
        assert out["no_clip"] == out["ref"]
        assert "step_in_backward" in out["error"], out["error"]
        assert out["same_weights"]


# ------------------------------------------------------------------- transactions
class Boom(RuntimeError):
    """Raised by a backward hook half-way through a backward."""


def _raise_in_backward(module, inputs, output):
    def boom(grad):
        raise Boom("half-way through backward")
    output.register_hook(boom)


def _nan_on_rank0(module, inputs, output):
    if dist.get_rank() == 0:
        output.register_hook(lambda grad: grad * float("nan"))


def _skip_in_memory(model, opt, step: int, fault: str) -> None:
    """Step ``step`` in memory as a user skips it: after an exception, as if it never ran (the
    reference is the clean run); after a non-finite grad norm seen by the user's check, zeroed."""
    if fault == "raise":
        return
    _step(model, opt, step, hook=_nan_on_rank0)
    assert not math.isfinite(float(grad_norm(model)))
    opt.zero_grad()


def body_transaction(tmp: str, fault: str):
    """Steps 0..3, step 1 failing (``fault``): in memory as a user skips it, on disk inside
    ``step_in_backward``, where the failed step must leave no trace."""
    ref, ref_opt, off, off_opt, store = _pair(tmp)
    ref_losses, off_losses, seen = [], [], {}
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("parts.offload").addHandler(handler)
    try:
        for step in range(4):
            if step == 1:
                _skip_in_memory(ref, ref_opt, step, fault)
                seen.update(_fail_on_disk(ref, off, off_opt, step, fault))
                continue
            ref_losses.append(_step(ref, ref_opt, step))
            ref_opt.step(), ref_opt.zero_grad()
            off_losses.append(_step(off, off_opt, step, in_backward=True))
            off_opt.step(), off_opt.zero_grad()
    finally:
        logging.getLogger("parts.offload").removeHandler(handler)
    seen["skipped"] = getattr(off_opt, "skipped_steps", -1)
    seen["reported"] = sum("skipped" in r.getMessage() for r in records)
    seen["same_losses"] = all(torch.equal(a, b) for a, b in zip(ref_losses, off_losses))
    seen["same_weights"] = _same_weights(ref, off)
    _close(ref, off, store)
    return seen


def _fail_on_disk(ref, off, opt, step: int, fault: str) -> dict:
    """The failing step on disk: the exception caught then ``zero_grad()``, or ``step()`` on a
    non-finite grad; the weights after it must be the memory run's (which skipped it)."""
    seen = {}
    if fault == "raise":
        try:
            _step(off, opt, step, True, _raise_in_backward)
        except Boom:
            seen["raised"] = True
    else:
        seen["finite_loss"] = bool(torch.isfinite(_step(off, opt, step, True, _nan_on_rank0)))
        seen["norm"] = float(grad_norm(off))
        opt.step()
    opt.zero_grad()
    staged = [k for k in opt.store.keys() if k.endswith(parking.STAGED)]
    seen["clean"] = (sum(parking.parked(p).holds for p in shard_tensors(off)), staged)  # nothing held or staged
    seen["kept_weights"] = _same_weights(ref, off)
    return seen


def test_exception_in_backward_rolls_the_step_back(tmp_path):
    for seen in run(2, body_transaction, str(tmp_path), "raise", timeout=FAST):
        assert seen["raised"] and seen["kept_weights"] and seen["skipped"] == 0
        assert seen["clean"] == (0, []), seen["clean"]
        assert seen["same_losses"] and seen["same_weights"]


def test_non_finite_grad_skips_the_step_in_backward(tmp_path):
    for seen in run(2, body_transaction, str(tmp_path), "nan", timeout=FAST):
        assert seen["finite_loss"] and not math.isfinite(seen["norm"]) and seen["kept_weights"]
        assert seen["clean"] == (0, []), seen["clean"]
        assert seen["skipped"] == 1 and seen["reported"] >= 1
        assert seen["same_losses"] and seen["same_weights"]


# ------------------------------------------------------------------- bookkeeping
def _live_ops() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is Op)


def body_bounded(tmp: str):
    """Live ``Op`` records after 5 and after 25 offloaded steps (stepping during backward), and
    after 5 and 25 forwards without grad: flat."""
    rank = dist.get_rank()
    store = DiskStore(f"{tmp}/r{rank}", block_bytes=4096, max_inflight_bytes=1 << 16)
    model = _build(store)
    attach(model, **KNOBS)
    opt = OffloadedOptimizer(torch.optim.AdamW(shards(model), lr=1e-2), store, chunk_bytes=20_000)
    counts = []
    for step in range(25):
        _step(model, opt, step % 4, in_backward=True)
        opt.step(), opt.zero_grad()
        if step in (4, 24):
            counts.append(_live_ops())
    with torch.no_grad():
        for call in range(25):
            model(*batch(call % 4, 2, 8 * rank))
            if call in (4, 24):
                counts.append(_live_ops())
    detach(model)
    store.close()
    return counts


@pytest.mark.slow
def test_store_bookkeeping_stays_bounded(tmp_path):
    for train_5, train_25, fwd_5, fwd_25 in run(2, body_bounded, str(tmp_path), timeout=FAST):
        assert train_25 <= train_5 and fwd_25 <= fwd_5, (train_5, train_25, fwd_5, fwd_25)


# ------------------------------------------------------------------ scratch space
def _child(parent: str, ready_w: int, chained: str) -> None:
    """A forked process holding a store with 1 MiB in it (``chained``: a SIGTERM handler of its
    own first, marking that file when called); never returns."""
    code = 0
    try:
        if chained:
            signal.signal(signal.SIGTERM, lambda s, f: open(chained, "w").close())
        store = DiskStore(parent)
        store.write("x", torch.ones(1 << 18)).wait()
        os.write(ready_w, store.directory.encode())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (chained and os.path.exists(chained)):
            time.sleep(0.01)
        store.close()
    except BaseException:  # noqa: BLE001 - a forked child must never return into the harness
        code = 1
    os._exit(code)


def _spawn(parent: str, chained: str = "") -> tuple[int, str]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(parent, w, chained)
    os.close(w)
    directory = os.read(r, 4096).decode()
    os.close(r)
    return pid, directory


def body_scratch(tmp: str):
    parent = f"{tmp}/r{dist.get_rank()}"
    out = {}
    live = DiskStore(parent)  # a live owner's directory is never reclaimed
    pid, directory = _spawn(parent)  # SIGTERM, default disposition: cleaned, then killed by it
    os.kill(pid, signal.SIGTERM)
    status = os.waitpid(pid, 0)[1]
    out["term_signal"] = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    out["term_removed"] = not os.path.exists(directory)
    marker = f"{parent}.chained"  # SIGTERM with a handler of the user's: it runs, the store survives
    pid, directory = _spawn(parent, marker)
    os.kill(pid, signal.SIGTERM)
    out["chained_exit"] = os.waitpid(pid, 0)[1]
    out["chained_called"] = os.path.exists(marker)
    out["chained_removed"] = not os.path.exists(directory)
    pid, killed = _spawn(parent)  # SIGKILL: left behind, reclaimed by the next store
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    out["killed_left"] = os.path.isdir(killed)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("parts.offload").addHandler(handler)
    try:
        fresh = DiskStore(parent)
    finally:
        logging.getLogger("parts.offload").removeHandler(handler)
    out["killed_removed"] = not os.path.exists(killed)
    out["live_kept"] = os.path.isdir(live.directory)
    out["reclaimed"] = fresh.reclaimed_bytes
    out["said"] = [r.getMessage() for r in records]
    fresh.close(), live.close()
    return out


def test_scratch_space_is_cleaned_on_sigterm_and_reclaimed(tmp_path):
    for out in run(2, body_scratch, str(tmp_path), timeout=FAST):
        assert out["term_signal"] and out["term_removed"]
        assert out["chained_called"] and out["chained_exit"] == 0 and out["chained_removed"]
        assert out["killed_left"] and out["killed_removed"] and out["live_kept"]
        assert out["reclaimed"] >= 1 << 20
        assert any("reclaimed" in m and "MiB" in m for m in out["said"]), out["said"]


def _busy_child(parent: str, ready_w: int) -> None:
    """A forked process whose store's IO threads keep creating files (new keys, never waited); never returns."""
    code = 0
    try:
        store = DiskStore(parent)
        os.write(ready_w, store.directory.encode())
        pending = []
        for i in range(100_000):
            pending.append(store.write(f"k{i}", torch.full((256,), float(i))))
            if len(pending) > 64:
                pending.pop(0).wait()
    except BaseException:  # noqa: BLE001 - a forked child must never return into the harness
        code = 1
    os._exit(code)


def body_sigterm_while_writing(tmp: str, runs: int) -> list:
    """SIGTERM a writing child ``runs`` times: what each left in its directory (None: nothing)."""
    left = []
    for k in range(runs):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _busy_child(f"{tmp}/r{dist.get_rank()}-{k}", w)
        os.close(w)
        directory = os.read(r, 4096).decode()
        os.close(r)
        time.sleep(0.05 + 0.02 * k)  # the threads are creating and writing files now
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
        left.append(sorted(os.listdir(directory)) if os.path.exists(directory) else None)
    return left


def test_sigterm_while_the_io_threads_create_files_leaves_no_scratch_behind(tmp_path):
    """The handler removes the directory while the IO threads still create files in it: it removes
    until the directory is gone (no thread can create a file in it after that)."""
    for left in run(2, body_sigterm_while_writing, str(tmp_path), 4, timeout=FAST):
        assert left == [None] * 4, left


def _making_child(parent: str) -> None:
    """A forked process making a store under ``parent`` (reclaiming a dead owner's directory there); never returns."""
    code = 0
    try:
        DiskStore(parent)
        time.sleep(30)
    except BaseException:  # noqa: BLE001 - a forked child must never return into the harness
        code = 1
    os._exit(code)


def body_sigterm_while_making(tmp: str, runs: int) -> list:
    """SIGTERM a child as soon as its store directory appears (it is still reclaiming a dead owner's
    3,000 files): how it ended and what it left besides the dead owner's directory."""
    out = []
    for k in range(runs):
        parent = f"{tmp}/r{dist.get_rank()}-{k}"
        pid, dead = _spawn(parent)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        for i in range(3000):
            os.close(os.open(os.path.join(dead, f"{i:08d}.bin"), os.O_CREAT | os.O_WRONLY, 0o600))
        pid = os.fork()
        if pid == 0:
            _making_child(parent)
        while len(os.listdir(parent)) < 2:
            time.sleep(0.0005)
        os.kill(pid, signal.SIGTERM)
        status = os.waitpid(pid, 0)[1]
        left = sorted(n for n in os.listdir(parent) if os.path.join(parent, n) != dead)
        out.append((os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, left))
    return out


@pytest.mark.slow
def test_sigterm_while_a_store_is_being_made_leaves_no_scratch_behind(tmp_path):
    """The directory is the handler's from the moment it exists: a SIGTERM while the store writes
    its owner record or reclaims dead owners' directories removes it too."""
    for runs in run(2, body_sigterm_while_making, str(tmp_path), 3, timeout=FAST):
        assert runs == [(True, [])] * 3, runs
