"""parts.comm.dcp.async_save: the files equal a blocking save's, the state is the one at the
call, host buffers are reused, errors reach wait() and the next save on every rank, a rank
killed during the background write leaves the previous checkpoint loadable, and a script that
ends without waiting still commits (or reports) its last save."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from harness import RankFailure, run

ROOT = Path(__file__).resolve().parents[1]
SLOW = 240.0  # DCP's first import in a worker takes seconds on a loaded 2-core machine


def _build(seed: int = 0):
    from parts.partition import partitioned, shards
    torch.manual_seed(seed)
    with partitioned():
        model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.LayerNorm(9), torch.nn.Linear(9, 5))
    return model, torch.optim.Adam(shards(model), lr=1e-2)


def _step(model, opt, seed: int) -> None:
    import torch.distributed as dist
    from parts.partition import gathered
    generator = torch.Generator().manual_seed(seed + dist.get_rank())
    with gathered(list(model.parameters())):
        model(torch.randn(4, 6, generator=generator)).square().mean().backward()
    from parts.partition import reduce_scatter_grads
    reduce_scatter_grads(list(model.parameters()))
    opt.step()
    opt.zero_grad()


def _state(model, opt, step: int) -> dict:
    from parts.partition import sharded_optimizer_state_dict, sharded_state_dict
    return {"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, opt), "step": step}


def _loaded(path: str) -> tuple[list[torch.Tensor], int]:
    """This rank's shards and optimizer state tensors after loading ``path`` into a fresh model."""
    from parts.comm import dcp
    from parts.partition import load_sharded_optimizer_state_dict, load_sharded_state_dict, shards
    model, opt = _build(seed=9)
    state = _state(model, opt, 0)
    dcp.load(state, checkpoint_id=path)
    load_sharded_state_dict(model, state["model"])
    load_sharded_optimizer_state_dict(model, opt, state["optim"])
    tensors = [s.detach().clone() for s in shards(model)]
    tensors += [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return tensors, state["step"]


def _current(model, opt) -> list[torch.Tensor]:
    from parts.partition import shards
    return [s.detach().clone() for s in shards(model)] + \
        [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def async_equals_blocking(root: str) -> dict:
    from parts.comm import dcp
    from parts.comm.async_save import _Process
    model, opt = _build()
    _step(model, opt, 1)
    _step(model, opt, 2)
    at_save = _current(model, opt)
    dcp.save(_state(model, opt, 2), checkpoint_id=f"{root}/blocking")
    pending = dcp.async_save(_state(model, opt, 2), checkpoint_id=f"{root}/async")
    _step(model, opt, 3)  # the save must hold the state at the call, not this one
    pending.wait()
    first = {b.data_ptr() for b in _Process.host._buffers.values()}
    dcp.async_save(_state(model, opt, 3), checkpoint_id=f"{root}/async-2").wait()
    second = {b.data_ptr() for b in _Process.host._buffers.values()}
    blocking, async_ = _loaded(f"{root}/blocking"), _loaded(f"{root}/async")
    return {"equal": len(blocking[0]) == len(async_[0]) and all(torch.equal(a, b)
                                                              for a, b in zip(blocking[0], async_[0])),
            "steps": (blocking[1], async_[1]),
            "at_save": all(torch.equal(a, b) for a, b in zip(at_save, async_[0])),
            "moved_on": not all(torch.equal(a, b) for a, b in zip(_current(model, opt), async_[0])),
            "buffers_reused": first == second and len(first) > 0,
            "names": sorted(os.listdir(f"{root}/async")) == sorted(os.listdir(f"{root}/blocking"))}


@pytest.mark.parametrize("world", [2, 3])
def test_async_save_files_load_bitwise_equal_to_a_blocking_save_of_the_state_at_the_call(tmp_path: Path,
                                                                                         world: int) -> None:
    for rank, got in enumerate(run(world, async_equals_blocking, str(tmp_path), timeout=SLOW)):
        assert got == {"equal": True, "steps": (2, 2), "at_save": True, "moved_on": True,
                       "buffers_reused": True, "names": True}, (rank, got)


class FailingWriter(FileSystemWriter):
    """A file-system writer whose writes fail on one rank (a full disk, say)."""

    failing_rank = 1

    def write_data(self, plan, planner):
        import torch.distributed as dist
        if dist.get_rank() == self.failing_rank:
            raise OSError(28, "No space left on device (injected)")
        return super().write_data(plan, planner)


def errors_surface(root: str) -> dict:
    from parts.comm import dcp
    from parts.comm.dcp import CheckpointError
    model, opt = _build()
    _step(model, opt, 1)
    dcp.save(_state(model, opt, 1), checkpoint_id=f"{root}/ck")
    before = _loaded(f"{root}/ck")[0]
    _step(model, opt, 2)
    seen = {}
    pending = dcp.async_save(_state(model, opt, 2), storage_writer=FailingWriter(f"{root}/ck"))
    try:
        pending.wait()
    except CheckpointError as exc:
        seen["wait"] = (exc.ranks, "No space left on device" in str(exc))
    dcp.async_save(_state(model, opt, 2), storage_writer=FailingWriter(f"{root}/ck"))
    try:  # nobody waited: the next save raises it
        dcp.async_save(_state(model, opt, 2), checkpoint_id=f"{root}/ck")
    except CheckpointError as exc:
        seen["next save"] = (exc.ranks, "No space left on device" in str(exc))
    after = _loaded(f"{root}/ck")[0]
    seen["previous kept"] = all(torch.equal(a, b) for a, b in zip(before, after))
    dcp.async_save(_state(model, opt, 2), checkpoint_id=f"{root}/ck").wait()  # the error was raised once
    seen["then saves"] = not all(torch.equal(a, b) for a, b in zip(before, _loaded(f"{root}/ck")[0]))
    seen["staging left"] = sorted(n for n in os.listdir(root) if n != "ck")
    return seen


@pytest.mark.parametrize("world", [2, 3])
def test_a_failed_background_write_raises_on_wait_and_on_the_next_save_on_every_rank(tmp_path: Path,
                                                                                     world: int) -> None:
    for rank, seen in enumerate(run(world, errors_surface, str(tmp_path), timeout=SLOW)):
        assert seen == {"wait": ([1], True), "next save": ([1], True), "previous kept": True,
                        "then saves": True, "staging left": []}, (rank, seen)


class KillingWriter(FileSystemWriter):
    """A file-system writer that SIGKILLs its process on one rank after writing its files."""

    victim = 1

    def write_data(self, plan, planner):
        import torch.distributed as dist
        futures = super().write_data(plan, planner)
        if dist.get_rank() == self.victim:
            futures.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return futures


def save_then_die(root: str, victim: int) -> str:
    from parts.comm import dcp
    model, opt = _build()
    _step(model, opt, 1)
    dcp.save(_state(model, opt, 1), checkpoint_id=f"{root}/ck")
    _step(model, opt, 2)
    writer = KillingWriter(f"{root}/ck")
    writer.victim = victim
    dcp.async_save(_state(model, opt, 2), storage_writer=writer)
    if torch.distributed.get_rank() == victim:
        signal.pause()  # the background thread kills this process
    return "returned"


def reference(root: str) -> list[torch.Tensor]:
    model, opt = _build()
    _step(model, opt, 1)
    return _current(model, opt)


def load_values(root: str) -> tuple[list[torch.Tensor], int]:
    return _loaded(f"{root}/ck")


@pytest.mark.parametrize("world,victim", [(2, 1), (3, 0)])
def test_a_rank_killed_during_the_background_write_leaves_the_previous_checkpoint_loadable(
        tmp_path: Path, world: int, victim: int) -> None:
    with pytest.raises(RankFailure):
        run(world, save_then_die, str(tmp_path), victim, timeout=SLOW)
    assert any(".saving" in name for name in os.listdir(tmp_path))  # killed while staged
    expected = run(world, reference, str(tmp_path), timeout=SLOW)
    for rank, (tensors, step) in enumerate(run(world, load_values, str(tmp_path), timeout=SLOW)):
        assert step == 1 and all(torch.equal(a, b) for a, b in zip(tensors, expected[rank])), rank


SCRIPT = """
import sys, torch
from torch.distributed.checkpoint import FileSystemWriter
from parts.comm import dcp

class Failing(FileSystemWriter):
    def write_data(self, plan, planner):
        raise OSError(28, "No space left on device (injected)")

path, mode = sys.argv[1], sys.argv[2]
state = {"w": torch.arange(6.0), "step": 4}
if mode == "ok":
    dcp.async_save(state, checkpoint_id=path)
else:
    dcp.async_save(state, storage_writer=Failing(path))
print("returned", flush=True)
"""


def _script(tmp_path: Path, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(SCRIPT), str(tmp_path / mode), mode],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_script_ending_without_wait_commits_its_last_async_save_or_exits_1_naming_the_error(
        tmp_path: Path) -> None:
    from parts.comm import dcp
    launched = {mode: _script(tmp_path, mode) for mode in ("ok", "fail")}  # side by side
    (out, err), code = launched["ok"].communicate(timeout=240), launched["ok"].returncode
    assert code == 0 and "returned" in out, err
    state = {"w": torch.zeros(6), "step": 0}
    dcp.load(state, checkpoint_id=tmp_path / "ok")
    assert torch.equal(state["w"], torch.arange(6.0)) and state["step"] == 4
    (out, err), code = launched["fail"].communicate(timeout=240), launched["fail"].returncode
    assert code == 1 and "returned" in out, err
    assert "failed and nobody waited for it" in err and "No space left on device" in err


def disk_checkpoints(scratch: str) -> None:
    """Shards and optimizer state in a DiskStore: a blocking save and an async save of the same state."""
    import torch.distributed as dist
    from test_dcp_offload import _model, _optimizer, _train

    from parts.comm import dcp
    from parts.offload import DiskStore
    from parts.partition import sharded_optimizer_state_dict, sharded_state_dict
    store = DiskStore(f"{scratch}/store-{dist.get_rank()}")
    model = _model("adam", store)
    opt = _optimizer("adam", model, store)
    _train(model, opt, 2)

    def state() -> dict:
        return {"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, opt)}
    dcp.save(state(), checkpoint_id=f"{scratch}/blocking")
    dcp.async_save(state(), checkpoint_id=f"{scratch}/async").wait()
    store.close()


def test_an_async_save_of_state_in_a_disk_store_equals_a_blocking_one(tmp_path: Path) -> None:
    from test_dcp_offload import _consolidated, _same
    run(2, disk_checkpoints, str(tmp_path), timeout=SLOW)
    blocking, async_ = _consolidated(tmp_path / "blocking"), _consolidated(tmp_path / "async")
    assert any(".state." in k for k in blocking) and _same(async_, blocking)
