"""parts.comm.Snapshots: host-memory snapshots restore the state at the save bitwise (weights,
optimizer state, RNG, step, the rank's own value), a torn or damaged generation is never
restored (the previous one is), a node's lost folder is recovered from its buddy's copy (at
the same world and resharded onto a smaller one), and a clean finish leaves nothing behind."""

from __future__ import annotations

import os
import random
import uuid

import pytest
import torch

from harness import run
from test_dcp_async import SLOW, _build, _step


def _state(model, opt) -> dict:
    from parts.partition import sharded_optimizer_state_dict, sharded_state_dict
    return {"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, opt)}


def _current(model, opt) -> list[torch.Tensor]:
    from parts.partition import shards
    return [s.detach().clone() for s in shards(model)] + \
        [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _restore_into_fresh(snaps) -> tuple[object, list[torch.Tensor], object]:
    from parts.partition import load_sharded_optimizer_state_dict, load_sharded_state_dict
    model, opt = _build(seed=9)
    _step(model, opt, 7)  # optimizer state exists, with other values
    state = _state(model, opt)
    restored = snaps.restore(state)
    load_sharded_state_dict(model, state["model"])
    load_sharded_optimizer_state_dict(model, opt, state["optim"])
    return restored, _current(model, opt), model


def _draws() -> tuple[torch.Tensor, float]:
    return torch.rand(4), random.random()


def _left(job: str) -> bool:
    from parts.comm.snapshot_files import default_root, job_folder
    return job_folder(default_root(), job).exists()


def round_trip(job: str) -> dict:
    import torch.distributed as dist
    from parts.comm import Snapshots
    model, opt = _build()
    _step(model, opt, 1)
    snaps = Snapshots(every=2, job=job)
    with snaps:
        snaps.save(_state(model, opt), step=1)  # the next save reuses its plans
        _step(model, opt, 2)
        position = torch.tensor([dist.get_rank(), 2])
        snaps.save(_state(model, opt), step=2, local={"position": position})
        at_save, after = _current(model, opt), _draws()
        _step(model, opt, 3)  # the snapshot holds the state at the call
        snaps.wait()
        torch.manual_seed(99)
        random.seed(99)
        restored, loaded, _ = _restore_into_fresh(snaps)
        again = _draws()
    return {"step": restored.step, "weights_and_optimizer": len(loaded) == len(at_save) and len(loaded) > 4
            and all(torch.equal(a, b) for a, b in zip(loaded, at_save)),
            "rng": torch.equal(after[0], again[0]) and after[1] == again[1] and restored.rng_restored,
            "local": torch.equal(restored.local["position"], position), "disk_bytes": restored.disk_bytes,
            "left": _left(job)}


@pytest.mark.parametrize("world", [2, 3])
def test_snapshot_restores_weights_optimizer_rng_step_and_position_bitwise_and_leaves_nothing(world: int) -> None:
    job = f"test-{uuid.uuid4().hex[:8]}"
    for rank, got in enumerate(run(world, round_trip, job, timeout=SLOW)):
        assert got == {"step": 2, "weights_and_optimizer": True, "rng": True, "local": True, "disk_bytes": 0,
                       "left": False}, (rank, got)


def _damage(job: str, how: str) -> None:
    """Damage generation 2 on every node as ``how`` says (rank 0 of the caller)."""
    from parts.comm.snapshot_files import default_root, job_folder
    for node in sorted(job_folder(default_root(), job).glob("node-*")):
        gen = node / "gen-00000002"
        victim = sorted(gen.glob("__1_*.distcp"))[0]
        if how == "truncated":
            os.truncate(victim, victim.stat().st_size // 2)
        elif how == "corrupted":  # the same size: only the checksum tells
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))
        else:  # killed before its commit: the folder is still the staging one
            os.rename(gen, node / "gen-00000002.saving")


def torn(job: str, how: str) -> dict:
    import torch.distributed as dist
    from parts.comm import Snapshots, all_gather_objects
    model, opt = _build()
    with Snapshots(every=1, job=job) as snaps:
        _step(model, opt, 1)
        snaps.save(_state(model, opt), step=1)
        first = _current(model, opt)
        _step(model, opt, 2)
        snaps.save(_state(model, opt), step=2)
        snaps.wait()
        if dist.get_rank() == 0:
            _damage(job, how)
        all_gather_objects(None)
        restored, loaded, _ = _restore_into_fresh(snaps)
    return {"step": restored.step, "generation": restored.generation,
            "first": all(torch.equal(a, b) for a, b in zip(loaded, first)), "left": _left(job)}


@pytest.mark.parametrize("world,how", [(2, "truncated"), (3, "corrupted"), (2, "unfinished")])
def test_a_torn_or_damaged_snapshot_is_refused_and_the_previous_one_restored(world: int, how: str) -> None:
    job = f"test-{uuid.uuid4().hex[:8]}"
    for rank, got in enumerate(run(world, torn, job, how, timeout=SLOW)):
        assert got == {"step": 1, "generation": 1, "first": True, "left": False}, (rank, got)


def _full(model) -> dict:
    from parts.partition import full_state_dict
    return {k: v.clone() for k, v in full_state_dict(model).items()}


def save_on_two_nodes(job: str, lose: bool, close: bool) -> dict:
    """World 4 as two nodes of two ranks: a snapshot, then node 1's folder removed (rank 0)."""
    import torch.distributed as dist
    from parts.comm import Snapshots, all_gather_objects
    from parts.comm.snapshot_files import default_root, job_folder, node_folder
    model, opt = _build()
    snaps = Snapshots(every=1, job=job, node_size=2)
    _step(model, opt, 1)
    snaps.save(_state(model, opt), step=1)
    at_save, full = _current(model, opt), _full(model)
    snaps.wait()
    if lose and dist.get_rank() == 0:
        import shutil
        shutil.rmtree(node_folder(job_folder(default_root(), job), 1))
    all_gather_objects(None)
    out = {"full": full}
    if close:
        restored, loaded, _ = _restore_into_fresh(snaps)
        out.update(step=restored.step, same=all(torch.equal(a, b) for a, b in zip(loaded, at_save)))
        snaps.close()
        out["left"] = _left(job)
    return out


def restore_resharded(job: str) -> dict:
    from parts.comm import Snapshots
    snaps = Snapshots(every=1, job=job)
    restored, _, model = _restore_into_fresh(snaps)
    full = _full(model)
    snaps.close()
    return {"step": restored.step, "rng_restored": restored.rng_restored, "full": full, "left": _left(job)}


def test_a_lost_node_is_restored_from_its_buddy_copy_at_world_4() -> None:
    job = f"test-{uuid.uuid4().hex[:8]}"
    for rank, got in enumerate(run(4, save_on_two_nodes, job, True, True, timeout=SLOW)):
        got.pop("full")
        assert got == {"step": 1, "same": True, "left": False}, (rank, got)


def test_a_lost_node_is_restored_from_its_buddy_copy_resharded_from_4_ranks_to_2() -> None:
    job = f"test-{uuid.uuid4().hex[:8]}"
    saved = run(4, save_on_two_nodes, job, True, False, timeout=SLOW)[0]["full"]
    for rank, got in enumerate(run(2, restore_resharded, job, timeout=SLOW)):
        full = got.pop("full")
        assert got == {"step": 1, "rng_restored": False, "left": False}, (rank, got)
        if rank == 0:  # the full state dict gathers on rank 0
            assert sorted(full) == sorted(saved) and all(torch.equal(full[k], saved[k]) for k in saved)


def dead_job_reclaimed(job: str, dead: str) -> dict:
    import json
    import torch.distributed as dist
    from parts.base import owner_records as owner
    from parts.comm import Snapshots, all_gather_objects
    from parts.comm.snapshot_files import default_root, job_folder
    folder = job_folder(default_root(), dead)
    if dist.get_rank() == 0:  # a job whose owner (a process that ran here) is gone
        (folder / "node-0" / "gen-00000001").mkdir(parents=True)
        (folder / "node-0" / "gen-00000001" / "__0_0.distcp").write_bytes(b"x" * 1000)
        record = {**owner.record(), "pid": 2**22 + 7, "start": "1"}
        (folder / "owner.json").write_text(json.dumps(record))
    all_gather_objects(None)
    with Snapshots(every=1, job=job) as snaps:
        snaps.start()
        reclaimed = snaps.reclaimed_bytes
    return {"reclaimed": reclaimed if dist.get_rank() == 0 else None, "dead_left": folder.exists(),
            "left": _left(job)}


def test_a_dead_jobs_snapshots_are_reclaimed_by_the_next_start() -> None:
    job, dead = f"test-{uuid.uuid4().hex[:8]}", f"test-dead-{uuid.uuid4().hex[:8]}"
    first, second = run(2, dead_job_reclaimed, job, dead, timeout=SLOW)
    assert first["reclaimed"] >= 1000 and second["reclaimed"] is None, (first, second)
    assert [first["dead_left"], first["left"], second["dead_left"], second["left"]] == [False] * 4


def roots_not_shared(root: str) -> str:
    import torch.distributed as dist
    from parts.comm import Snapshots
    try:
        Snapshots(every=1, job="unshared", root=f"{root}/rank{dist.get_rank()}").start()
    except ValueError as error:
        return str(error)
    return "started"


def test_ranks_that_do_not_see_one_root_folder_are_refused_on_every_rank(tmp_path) -> None:
    for got in run(2, roots_not_shared, str(tmp_path), timeout=SLOW):
        assert "group rank(s) [1] do not see" in got, got


def reused_run_id(run_id: str) -> dict:
    import json
    import torch.distributed as dist
    from parts.base import owner_records
    from parts.comm import Snapshots, all_gather_objects
    from parts.comm.snapshot_files import default_root, job_folder
    folder = job_folder(default_root(), run_id)
    if dist.get_rank() == 0:  # an earlier torchrun job of this run id, its agent gone, left a snapshot
        (folder / "node-0" / "gen-00000001").mkdir(parents=True)
        record = {**owner_records.record(), "pid": 2**22 + 7, "start": "1"}
        (folder / "owner.json").write_text(json.dumps(record))
    all_gather_objects(None)
    os.environ["TORCHELASTIC_RUN_ID"] = run_id
    try:
        with Snapshots(every=1) as snaps:
            model, opt = _build()
            restored = snaps.restore(_state(model, opt))
            old_gone = not (folder / "node-0" / "gen-00000001").exists()
    finally:
        del os.environ["TORCHELASTIC_RUN_ID"]
    return {"restored": restored, "old_gone": old_gone, "left": folder.exists()}


def test_a_run_id_reused_after_its_agent_is_gone_starts_afresh() -> None:
    for got in run(2, reused_run_id, f"test-{uuid.uuid4().hex[:8]}", timeout=SLOW):
        assert got == {"restored": None, "old_gone": True, "left": False}, got
