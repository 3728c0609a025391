"""Shards on disk (partitioned(remote_device=DiskStore)): bitwise the in-memory run, reads ahead."""

import contextlib

import pytest
import torch
import torch.distributed as dist

from harness import run
from test_coordinator_models import GPT, batch
from parts.offload import DiskStore, OffloadedOptimizer
from parts.offload import parking
from parts.partition import (attach, detach, full_state_dict, load_full_state_dict, meta,
                             partitioned, shards)
from parts.partition.core import disk

KNOBS = dict(prefetch_bucket_size=3000, max_live_parameters=6000, persistence_threshold=60,
             max_reuse_distance=0)


def _build(remote, seed=0):
    torch.manual_seed(seed)
    with partitioned(remote_device=remote):
        return GPT(layers=3)


def _train(model, opt, steps, rank, micro_on=1, in_backward=False):
    """Steps of 4 rows per rank; step ``micro_on`` accumulates two micro-batches of 2 (the last
    backward of a step runs inside ``opt.step_in_backward()`` when ``in_backward``)."""
    losses = []
    for step in range(steps):
        micro = [(0, 2), (2, 2)] if step == micro_on else [(0, 4)]
        for k, (off, rows) in enumerate(micro):
            loss = model(*batch(step, rows, 8 * rank + off))
            last = in_backward and k == len(micro) - 1
            with opt.step_in_backward() if last else contextlib.nullcontext():
                loss.backward()
            losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
    return losses


def body_equivalence(tmp, remote_kind):
    """The same run in memory and with shards (and optimizer state) on disk: bitwise equal."""
    rank = dist.get_rank()
    ref = _build("cpu" if remote_kind == "cpu" else None)
    store = DiskStore(f"{tmp}/r{rank}", block_bytes=4096, max_inflight_bytes=1 << 16)
    off = _build(store)
    assert all(p.untyped_storage().nbytes() == 0 for p in shards(off))
    started = []
    real = disk.read_ahead
    disk.read_ahead = lambda *a, **k: started.append(real(*a, **k)) or started[-1]
    try:
        attach(ref, **KNOBS), attach(off, **KNOBS)
        ref_opt = torch.optim.AdamW(shards(ref), lr=1e-2)
        off_opt = OffloadedOptimizer(torch.optim.AdamW(shards(off), lr=1e-2), store, chunk_bytes=20_000)
        ref_losses = _train(ref, ref_opt, 3, rank)
        off_losses = _train(off, off_opt, 3, rank)
    finally:
        disk.read_ahead = real
    same_losses = all(torch.equal(a, b) for a, b in zip(ref_losses, off_losses))
    sd_ref, sd_off = full_state_dict(ref), full_state_dict(off)
    same_params = sorted(sd_ref) == sorted(sd_off) and all(torch.equal(sd_ref[k], sd_off[k]) for k in sd_ref)
    resident = [p for p in shards(off) if p.untyped_storage().nbytes()]
    detach(ref), detach(off)
    out = (same_losses, same_params, sum(started), store.stats.bytes_read, len(resident))
    store.close()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_disk_equals_memory(tmp_path, world):
    results = run(world, body_equivalence, str(tmp_path), "none")
    for same_losses, same_params, reads_ahead, bytes_read, resident in results:
        assert same_losses and same_params
        assert reads_ahead > 0 and bytes_read > 0
        assert resident == 0  # no shard buffer outlives its all-gather or the optimizer step


def test_cpu_remote_device_still_works(tmp_path):
    same_losses, same_params, *_ = run(2, body_equivalence, str(tmp_path), "cpu")[0]
    assert same_losses and same_params


def body_plain_optimizer_refused(tmp):
    store = DiskStore(f"{tmp}/r{dist.get_rank()}")
    model = _build(store)
    attach(model)
    opt = torch.optim.AdamW(shards(model), lr=1e-2)
    model(*batch(0, 2)).backward()
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    finally:
        detach(model)
        store.close()
    return "no error"


def test_plain_optimizer_on_disk_shards_raises(tmp_path):
    message = run(1, body_plain_optimizer_refused, str(tmp_path))[0]
    assert "AdamW.step() on tensor" in message and "OffloadedOptimizer(optimizer, store)" in message


def body_state_dicts(tmp):
    """full_state_dict / load_full_state_dict and optimizer state dicts with shards on disk."""
    rank = dist.get_rank()
    ref, store = _build(None, seed=1), DiskStore(f"{tmp}/r{rank}", block_bytes=4096)
    off = _build(store, seed=2)  # other values: the load must overwrite them all
    sd = full_state_dict(ref)
    load_full_state_dict(off, sd if rank == 0 else {})
    attach(ref, **KNOBS), attach(off, **KNOBS)
    ref_opt = torch.optim.AdamW(shards(ref), lr=1e-2)
    off_opt = OffloadedOptimizer(torch.optim.AdamW(shards(off), lr=1e-2), store, chunk_bytes=5000)
    _train(ref, ref_opt, 2, rank)
    _train(off, off_opt, 2, rank)
    # the optimizer state moves to a third model (on disk, its own store keys) and goes on identically
    third, weights = _build(store, seed=3), full_state_dict(off)  # {} on rank 1
    load_full_state_dict(third, weights)
    attach(third, **KNOBS)
    third_opt = OffloadedOptimizer(torch.optim.AdamW(shards(third), lr=1e-2), store, prefix="third")
    third_opt.load_state_dict(off_opt.state_dict())
    same_opt = all(torch.equal(a, b) for a, b in zip(
        _flat_state(ref_opt.state_dict()), _flat_state(third_opt.state_dict())))
    _train(ref, ref_opt, 1, rank)
    _train(third, third_opt, 1, rank)
    a, b = full_state_dict(ref), full_state_dict(third)
    same = all(torch.equal(a[k], b[k]) for k in a) and len(a) == len(b)
    for m in (ref, off, third):
        detach(m)
    store.close()
    return same, same_opt, rank == 0 or a == {}


def _flat_state(sd):
    return [v for i in sorted(sd["state"]) for _, v in sorted(sd["state"][i].items())]


def test_state_dicts_with_disk_shards(tmp_path):
    for same, same_opt, ok in run(2, body_state_dicts, str(tmp_path)):
        assert same and same_opt and ok


def body_version(tmp):
    from parts.partition.core.param import is_stale
    from parts.partition import gather, release
    store = DiskStore(f"{tmp}/v")
    model = _build(store)
    p = model.ln_f.weight
    gather([p])
    assert not is_stale(meta(p))
    parking.load(meta(p).shard)
    with torch.no_grad():
        meta(p).shard.add_(1.0)
    parking.save(meta(p).shard).wait()
    parking.drop(meta(p).shard)
    stale = is_stale(meta(p))
    release([p])
    gather([p])
    fresh = torch.equal(p.detach(), torch.full_like(p.detach(), 2.0))  # LayerNorm weight 1 + 1
    release([p])
    store.close()
    return stale, fresh


def test_saved_shard_is_stale_and_regathered(tmp_path):
    assert run(1, body_version, str(tmp_path)) == [(True, True)]
