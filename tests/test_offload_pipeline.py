"""OffloadedOptimizer across steps: writes left behind by a step, reads started ahead of the next.

A slow writer (every piece of a shard or state write sleeps before it reads its memory) keeps
the last chunk's writes in flight while the next forward runs, gathers, drops shards and the
state dicts are taken: a buffer freed or reused before its write finished would write wrong
bytes (or fail), and the run would differ from the in-memory one.
"""

import copy
import os
import time

import pytest
import torch
import torch.distributed as dist

from harness import run
from test_offload_partition import KNOBS, _build, _train
from parts.offload import DiskStore, OffloadedOptimizer, _fileio
from parts.partition import attach, detach, full_state_dict, shards

SLOW = 0.02  # seconds a write piece waits before it reads its source memory


def _slow_writes(store: DiskStore, slept: list, torn: list) -> None:
    """Make every write piece of ``store`` (buffered: the piece is the caller's memory) sleep before
    it writes; a piece whose bytes changed meanwhile (its memory freed or reused) goes to ``torn``."""
    real = _fileio.OPS.pwritev
    mine = os.path.realpath(store.directory)

    def slow(fd, bufs, offset):
        if os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")) == mine:
            before = bytes(bufs[0])
            slept.append(1)
            time.sleep(SLOW)
            if bytes(bufs[0]) != before:
                torn.append((os.readlink(f"/proc/self/fd/{fd}"), offset))
        return real(fd, bufs, offset)

    _fileio.OPS.pwritev = slow


def _in_flight(opt: OffloadedOptimizer, params) -> tuple[int, int]:
    """(writes of values and state step() left behind, state reads it started ahead); whether
    they are still in flight now depends on the machine's load, so not asserted. (Parked values
    alone may all be waited already: the coordinator gathers the persistent parameters a step
    changed right after it, and the last chunk may hold only those.)"""
    behind = len(opt._behind.handles) if opt._behind is not None else 0
    ahead = sum(len(batch.handles) for batch in opt._ahead)
    return behind, ahead


def body_slow_writer(tmp):
    """Three steps in memory and on disk with slow writes; state dicts taken mid-pipeline."""
    rank = dist.get_rank()
    ref = _build(None)
    store = DiskStore(f"{tmp}/r{rank}", block_bytes=4096, direct=False)
    off = _build(store)
    attach(ref, **KNOBS), attach(off, **KNOBS)
    ref_opt = torch.optim.AdamW(shards(ref), lr=1e-2)
    off_opt = OffloadedOptimizer(torch.optim.AdamW(shards(off), lr=1e-2), store, chunk_bytes=20_000)
    real, slept, torn = _fileio.OPS.pwritev, [], []
    _slow_writes(store, slept, torn)
    try:
        same, flights = [], []
        for step in range(3):
            losses = [_train(ref, ref_opt, 1, rank), _train(off, off_opt, 1, rank)]
            flights.append(_in_flight(off_opt, shards(off)))  # before anything waits for them
            same.append(all(torch.equal(a, b) for a, b in zip(*losses)))
        sd_ref, sd_off = full_state_dict(ref), full_state_dict(off)  # drops of pending shards
        same.append(all(torch.equal(sd_ref[k], sd_off[k]) for k in sd_ref))
        o_ref, o_off = ref_opt.state_dict(), off_opt.state_dict()  # settles the pipeline
        same.append(all(torch.equal(v, o_off["state"][i][k]) for i, st in o_ref["state"].items()
                        for k, v in st.items()))
        losses = [_train(ref, ref_opt, 2, rank), _train(off, off_opt, 2, rank)]  # goes on after it
        same.append(all(torch.equal(a, b) for a, b in zip(*losses)))
    finally:
        _fileio.OPS.pwritev = real
    detach(ref), detach(off)
    store.close()
    return same, flights, len(slept), torn


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_writes_behind_and_reads_ahead_stay_bitwise_under_a_slow_writer(tmp_path, world):
    for same, flights, slept, torn in run(world, body_slow_writer, str(tmp_path), timeout=120.0):
        assert torn == [] and all(same), (torn, same)
        assert slept > 0
        # every step returned with shard writes behind and the next step's first state reads
        # ahead (the slow writer keeps them in flight through the next forward unless the
        # machine is very loaded; a drop that did not wait for them would tear pieces)
        assert all(behind > 0 and ahead > 0 for behind, ahead in flights), flights


def test_reads_ahead_of_a_chunk_the_next_step_skips_are_dropped(tmp_path):
    """A step where the first parameter has no grad starts at another chunk: the state read
    ahead for the first one is dropped (not installed), and the run stays bitwise in memory's."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    off = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with DiskStore(tmp_path, block_bytes=4096) as store:
        opt = OffloadedOptimizer(torch.optim.AdamW(off.parameters(), lr=1e-2), store, chunk_bytes=64 * 64 * 16)
        first = (id(off[0].weight),)
        for step in range(4):
            for model, o in ((ref, ref_opt), (off, opt)):
                model(torch.randn(4, 64, generator=torch.Generator().manual_seed(step))).square().mean().backward()
                if step == 2:
                    model[0].weight.grad = None
                ahead = opt._ahead[0].params if opt._ahead else None
                o.step()
                o.zero_grad()
            # read ahead: nothing before the first step; chunk (w0,) after steps 0, 1; after step
            # 2 (w0 frozen) its first chunk, not (w0,): steps 2 and 3 drop what was read ahead
            assert (ahead == first) == (step in (1, 2)) and (ahead is None) == (step == 0)
            w0 = off[0].weight  # what was read ahead and dropped was not installed in memory
            assert not [k for k, v in opt.state[w0].items() if torch.is_tensor(v) and v.shape == w0.shape]
        assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), off.parameters()))
        ref_sd, off_sd = ref_opt.state_dict(), opt.state_dict()
        assert all(torch.equal(v, off_sd["state"][i][k]) for i, st in ref_sd["state"].items() for k, v in st.items())
