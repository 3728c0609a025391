"""The multi-process harness itself: results per rank, tracebacks, timeouts, dead ranks."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from harness import RankFailure, run


def _rank_and_sum(offset):
    value = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), value.item()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_each_rank_returns_its_result(world_size):
    results = run(world_size, _rank_and_sum, 10)
    expected_sum = sum(rank + 10 for rank in range(world_size))
    assert results == [(rank, world_size, expected_sum) for rank in range(world_size)]


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank one")
    return "fine"


def test_failing_rank_reports_its_traceback():
    with pytest.raises(RankFailure) as info:
        run(2, _fail_on_rank_one)
    message = str(info.value)
    assert info.value.rank == 1
    assert "rank 1 of 2 raised" in message
    assert "ValueError: deliberate failure on rank one" in message
    assert "_fail_on_rank_one" in message  # the frame of the test body is in the traceback
    assert run(2, _rank_and_sum, 0)[1] == (1, 2, 1.0)  # the pool was recycled and works


def _fail_then_others_block():
    if dist.get_rank() == 0:
        raise RuntimeError("rank zero gives up before the collective")
    dist.all_reduce(torch.ones(1))  # never completes: rank 0 does not join


def test_failure_while_others_block_in_a_collective_does_not_hang():
    started = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run(3, _fail_then_others_block, timeout=30)
    assert info.value.rank == 0
    assert "rank zero gives up" in str(info.value)
    assert time.monotonic() - started < 20


def _sleep_forever():
    time.sleep(3600)


def test_timeout_fails_instead_of_hanging():
    with pytest.raises(RankFailure, match="timed out after 1 s"):
        run(2, _sleep_forever, timeout=1.0)
    assert run(2, _rank_and_sum, 1)[0] == (0, 2, 3.0)


def _die_on_last_rank():
    if dist.get_rank() == dist.get_world_size() - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_killed_worker_is_reported_and_replaced():
    with pytest.raises(RankFailure, match="rank 3 of 4 died"):
        run(4, _die_on_last_rank, timeout=30)
    assert [r[0] for r in run(4, _rank_and_sum, 0)] == [0, 1, 2, 3]


def _broadcast_tensor(tensor):
    dist.broadcast(tensor, src=0)
    return tensor


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 4), st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=8))
def test_hypothesis_examples_reuse_the_pool(world_size, values):
    tensor = torch.tensor(values)
    results = run(world_size, _broadcast_tensor, tensor)
    assert all(torch.equal(result, tensor) for result in results)


_left: dict = {}  # what one job leaves for the next, in this worker


def _drop_attached_model_in_a_cycle():
    import gc
    import weakref
    from parts.partition import attach, partitioned, shards
    torch.manual_seed(0)
    with partitioned():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    coordinator = attach(model)
    optimizer = torch.optim.SGD(shards(model), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    model.cycle = [model]
    _left["coordinator"] = weakref.ref(coordinator)
    gc.collect()  # the model is old by now, as a model that trained a while is


def _coordinator_left_alive():
    return _left.pop("coordinator")() is not None


def test_a_job_leaves_no_attached_model_in_a_cycle_for_the_next():
    # a coordinator still alive follows the next job's optimizer steps, on some ranks only
    run(2, _drop_attached_model_in_a_cycle)
    assert run(2, _coordinator_left_alive) == [False, False]
