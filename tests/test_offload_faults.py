"""Faults with shards on disk: a full disk is a clear error, a killed rank; checkpoints survive both."""

import contextlib
import errno
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import parts.io as pio
from harness import RankFailure, run
from test_coordinator_models import GPT, batch
from parts.offload import DiskStore, OffloadedOptimizer
from parts.offload import _fileio
from parts.partition import attach, detach, full_state_dict, partitioned, shards

KNOBS = dict(prefetch_bucket_size=3000, max_live_parameters=6000, persistence_threshold=60)


def _setup(tmp, on_disk):
    rank = dist.get_rank()
    store = DiskStore(f"{tmp}/store{rank}", block_bytes=4096) if on_disk else None
    torch.manual_seed(0)
    with partitioned(remote_device=store):
        model = GPT(layers=2)
    attach(model, **KNOBS)
    inner = torch.optim.AdamW(shards(model), lr=1e-2)
    opt = OffloadedOptimizer(inner, store, chunk_bytes=8000) if on_disk else inner
    return rank, store, model, opt


def _step(model, opt, step, rank, in_backward=False):
    loss = model(*batch(step, 4, 4 * rank))
    with opt.step_in_backward() if in_backward else contextlib.nullcontext():
        loss.backward()
    opt.step()
    opt.zero_grad()


def _checkpoint(tmp, model, opt, rank):
    """parts.io files: the weights (rank 0) and each rank's optimizer state."""
    weights = full_state_dict(model)
    if rank == 0:
        pio.save(weights, f"{tmp}/weights.pt")
    pio.save(opt.state_dict(), f"{tmp}/optim{rank}.pt")


def body_reference(tmp):
    rank, _, model, opt = _setup(tmp, on_disk=False)
    _step(model, opt, 0, rank)
    weights = full_state_dict(model)
    state = opt.state_dict()
    detach(model)
    return weights, state


def body_disk_fills(tmp, in_backward):
    """Step 0, checkpoint, then the device fills up during step 1: a clear error, named bytes."""
    rank, store, model, opt = _setup(tmp, on_disk=True)
    _step(model, opt, 0, rank, in_backward)
    _checkpoint(tmp, model, opt, rank)
    real, budget = _fileio.OPS.pwritev, [200_000]

    def filling(fd, bufs, offset):  # the device takes 200 kB more, then reports it is full
        if budget[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real(fd, bufs, offset)
        budget[0] -= n
        return n

    _fileio.OPS.pwritev = filling
    try:
        _step(model, opt, 1, rank, in_backward)
        return "no error"
    except OSError as e:
        return str(e)
    finally:
        _fileio.OPS.pwritev = real
        detach(model)
        store.close()


def _compare(tmp, reference, world):
    weights = pio.load(f"{tmp}/weights.pt")
    assert sorted(weights) == sorted(reference[0][0])
    assert all(torch.equal(weights[k], reference[0][0][k]) for k in weights)
    for rank in range(world):
        state = pio.load(f"{tmp}/optim{rank}.pt")["state"]
        ref = reference[rank][1]["state"]
        assert sorted(state) == sorted(ref)
        assert all(torch.equal(state[i][k], ref[i][k]) for i in ref for k in ref[i])


@pytest.mark.parametrize("in_backward", [False, True])
def test_full_disk_is_loud_and_the_checkpoint_loads(tmp_path, in_backward):
    messages = run(2, body_disk_fills, str(tmp_path), in_backward)
    for message in messages:
        assert "no space for" in message and "bytes in" in message and "parts-store-" in message, message
    _compare(tmp_path, run(2, body_reference, str(tmp_path / "ref")), 2)


def body_killed(tmp, in_backward):
    """Step 0, checkpoint, then rank 1 is killed while its optimizer writes state back."""
    rank, store, model, opt = _setup(tmp, on_disk=True)
    _step(model, opt, 0, rank, in_backward)
    _checkpoint(tmp, model, opt, rank)
    if rank == 1:
        real = store.write

        def die(key, tensor):
            if key.startswith("optim/"):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(key, tensor)

        store.write = die
    _step(model, opt, 1, rank, in_backward)
    _step(model, opt, 2, rank, in_backward)
    return "finished"


@pytest.mark.parametrize("in_backward", [False, True])
def test_killed_rank_leaves_the_checkpoint_loadable(tmp_path, in_backward):
    with pytest.raises(RankFailure, match="rank 1 of 2 died"):
        run(2, body_killed, str(tmp_path), in_backward, timeout=60)
    _compare(tmp_path, run(2, body_reference, str(tmp_path / "ref")), 2)


def body_store_file_lost(tmp, fault, in_backward):
    """Step 0, checkpoint, then one of rank 1's store files is truncated or deleted before step 1."""
    rank, store, model, opt = _setup(tmp, on_disk=True)
    _step(model, opt, 0, rank, in_backward)
    _checkpoint(tmp, model, opt, rank)
    dist.barrier()
    if rank == 1:
        files = sorted(str(f) for f in Path(store.directory).iterdir() if f.is_file())
        victim = files[len(files) // 2]
        if fault == "truncated":
            os.truncate(victim, 0)
        else:
            os.unlink(victim)
    _step(model, opt, 1, rank, in_backward)
    return "finished"


@pytest.mark.parametrize("world, fault, in_backward", [(2, "truncated", False), (2, "deleted", True),
                                                       (3, "truncated", True), (3, "deleted", False)])
def test_a_lost_store_file_names_file_and_key_and_the_checkpoint_loads(tmp_path, world, fault, in_backward):
    with pytest.raises(RankFailure) as failure:
        run(world, body_store_file_lost, str(tmp_path), fault, in_backward, timeout=60)
    message = str(failure.value)
    assert "rank 1 of" in message and f"the store file was {fault}" in message, message
    assert "parts-store-" in message and "cannot be read" in message and "key '" in message, message
    _compare(tmp_path, run(world, body_reference, str(tmp_path / "ref")), world)
