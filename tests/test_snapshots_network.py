"""parts.comm.Snapshots on nodes that do not share a root folder (hosts with memory of their own,
emulated by one root per node): the buddy copies travel over the network, a lost node's
snapshot comes back bitwise from the copies other nodes hold (at the same world, and resharded
onto a smaller one), and a torn or damaged copy is never restored (the previous generation is)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest
import torch

from harness import run
from test_dcp_async import SLOW, _build, _step
from test_snapshots import _current, _full, _restore_into_fresh, _state


def _root(base: str, node: int) -> str:
    return os.path.join(base, f"node{node}")


def _left(base: str) -> list[str]:
    return sorted(str(p) for p in Path(base).glob("node*/parts-snapshots-*"))


def _snaps(base: str, job: str, node_size: int, shared: bool = False):
    """Snapshots with a root per node (one for all with ``shared``: nodes emulated on one host)."""
    import torch.distributed as dist
    from parts.comm import Snapshots
    node = 0 if shared else dist.get_rank() // node_size
    return Snapshots(every=1, job=job, root=_root(base, node), node_size=node_size)


def _lose(base: str, node: int, job: str, damage: str) -> None:
    """Rank 0: remove node ``node``'s root; ``damage`` generation 2 of group rank 1's file where left."""
    shutil.rmtree(_root(base, node))
    victims = Path(base).glob(f"node*/parts-snapshots-{job}/node-*/gen-00000002/__1_0.distcp")
    for victim in sorted(victims) if damage else []:
        if damage == "truncated":
            os.truncate(victim, victim.stat().st_size // 2)
        else:  # the same size: only the checksum tells
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))


def save_lose_restore(base: str, job: str, node_size: int, damage: str) -> dict:
    """Two snapshots over the network; node 1's root lost (and generation 2 damaged); a restore."""
    import torch.distributed as dist
    from parts.comm import all_gather_objects
    model, opt = _build()
    snaps = _snaps(base, job, node_size).start()
    _step(model, opt, 1)
    snaps.save(_state(model, opt), step=1, local={"at": dist.get_rank()})
    first = _current(model, opt)
    _step(model, opt, 2)
    snaps.save(_state(model, opt), step=2, local={"at": dist.get_rank()})
    second = _current(model, opt)
    snaps.wait()
    if dist.get_rank() == 0:
        _lose(base, 1, job, damage)
    all_gather_objects(None)
    again = _snaps(base, job, node_size)
    restored, loaded, _ = _restore_into_fresh(again)
    expected = first if damage else second
    out = {"network": snaps.network and again.network, "sent": snaps.sent_bytes > 0, "step": restored.step,
           "local": restored.local, "same": len(loaded) == len(expected) and
           all(torch.equal(a, b) for a, b in zip(loaded, expected)),
           "fetched": restored.fetched_bytes > 0}
    again.close()
    all_gather_objects(None)
    return {**out, "left": _left(base)}


@pytest.mark.parametrize("world,node_size", [(2, 1), (3, 1)])
def test_a_lost_nodes_snapshot_comes_back_bitwise_from_copies_sent_over_the_network(tmp_path, world: int,
                                                                                    node_size: int) -> None:
    job = f"test-{uuid.uuid4().hex[:8]}"
    got = run(world, save_lose_restore, str(tmp_path), job, node_size, "", timeout=SLOW)
    for rank, out in enumerate(got):
        fetched = out.pop("fetched")
        assert out == {"network": True, "sent": True, "step": 2, "local": {"at": rank}, "same": True,
                       "left": []}, (rank, out)
        assert fetched or rank // node_size != 1, rank  # the lost node's ranks receive their files


@pytest.mark.parametrize("world,damage", [(2, "truncated"), (3, "corrupted")])
def test_a_torn_or_damaged_network_copy_is_refused_and_the_previous_generation_restored(
        tmp_path, world: int, damage: str) -> None:
    job = f"test-{uuid.uuid4().hex[:8]}"
    for rank, out in enumerate(run(world, save_lose_restore, str(tmp_path), job, 1, damage, timeout=SLOW)):
        out.pop("fetched")
        assert out == {"network": True, "sent": True, "step": 1, "local": {"at": rank}, "same": True,
                       "left": []}, (rank, out)


def save_on_two_nodes(base: str, job: str, hybrid: bool) -> dict:
    """World 4 as two nodes of two ranks with roots of their own (each a replica of a hybrid
    layout with ``hybrid``): one snapshot, node 1's root lost."""
    import torch.distributed as dist
    from parts.comm import all_gather_objects
    model, opt = _hybrid() if hybrid else _build()
    snaps = _snaps(base, job, 2).start()
    if not hybrid:
        _step(model, opt, 1)
    snaps.save(_state(model, opt), step=1)
    full = _full(model)
    snaps.wait()
    if dist.get_rank() == 0:
        shutil.rmtree(_root(base, 1))
    all_gather_objects(None)
    return {"full": full, "network": snaps.network, "node_checkpoints": snaps.node_checkpoints}


def restore_on(base: str, job: str, node_size: int) -> dict:
    """A restore resharded onto this world (node ``rank // node_size``'s root, empty past node 0)."""
    from parts.comm import all_gather_objects
    snaps = _snaps(base, job, node_size)
    restored, _, model = _restore_into_fresh(snaps)
    full = _full(model)
    snaps.close()
    all_gather_objects(None)
    return {"step": restored.step, "rng_restored": restored.rng_restored, "network": snaps.network,
            "full": full, "left": _left(base)}


@pytest.mark.parametrize("node_size,hybrid", [(2, False), (1, False), (1, True)])
def test_a_lost_node_is_restored_resharded_from_4_ranks_to_2_from_the_copies_on_the_other_node(
        tmp_path, node_size: int, hybrid: bool) -> None:
    job = f"test-{uuid.uuid4().hex[:8]}"
    saved = run(4, save_on_two_nodes, str(tmp_path), job, hybrid, timeout=SLOW)
    assert all(s["network"] and s["node_checkpoints"] == hybrid for s in saved)
    for rank, got in enumerate(run(2, restore_on, str(tmp_path), job, node_size, timeout=SLOW)):
        full = got.pop("full")
        assert got == {"step": 1, "rng_restored": False, "network": node_size == 1, "left": []}, (rank, got)
        if rank == 0:  # the full state dict gathers on rank 0
            assert sorted(full) == sorted(saved[0]["full"])
            assert all(torch.equal(full[k], saved[0]["full"][k]) for k in full)


def relaunch_by_name(base: str, job: str) -> dict:
    """A job named by its caller, relaunched under torchrun's variables after its first agent is gone."""
    import json
    import torch.distributed as dist
    from parts.base import owner_records
    from parts.comm import Snapshots, all_gather_objects
    from parts.comm.snapshot_files import job_folder
    model, opt = _build()
    _step(model, opt, 1)
    with Snapshots(every=1, job=job, root=base) as snaps:
        snaps.save(_state(model, opt), step=1)
        at_save = _current(model, opt)
        snaps.wait()
        if dist.get_rank() == 0:  # the first launch's agent is gone
            record = {**owner_records.record(), "pid": 2**22 + 7, "start": "1"}
            (job_folder(Path(base), job) / "owner.json").write_text(json.dumps(record))
        all_gather_objects(None)
        os.environ["TORCHELASTIC_RUN_ID"] = "relaunched"
        try:
            restored, loaded, _ = _restore_into_fresh(Snapshots(every=1, job=job, root=base))
        finally:
            del os.environ["TORCHELASTIC_RUN_ID"]
    return {"step": restored.step, "same": all(torch.equal(a, b) for a, b in zip(loaded, at_save))}


def test_a_job_named_by_its_caller_is_restored_by_a_relaunch_after_its_agent_is_gone(tmp_path) -> None:
    job = f"test-{uuid.uuid4().hex[:8]}"
    for rank, got in enumerate(run(2, relaunch_by_name, str(tmp_path), job, timeout=SLOW)):
        assert got == {"step": 1, "same": True}, (rank, got)


def _hybrid():
    """World 4 as 2 replicas (the nodes) x 2 shards, the replicas fed the same data: identical."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from parts.partition import gathered, partitioned, reduce_scatter_grads, shards
    torch.manual_seed(0)
    with partitioned(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))):
        model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.LayerNorm(9), torch.nn.Linear(9, 5))
    opt = torch.optim.Adam(shards(model), lr=1e-2)
    generator = torch.Generator().manual_seed(dist.get_rank() % 2)
    with gathered(list(model.parameters())):
        model(torch.randn(4, 6, generator=generator)).square().mean().backward()
    reduce_scatter_grads(list(model.parameters()))
    opt.step()
    return model, opt


def hybrid_lose_node(base: str, job: str, shared: bool, damage_node_0: bool = False) -> dict:
    """A hybrid layout's snapshot; node 1's folder lost (or, with ``damage_node_0``, node 0's
    copy of rank 0's file truncated); a restore at world 4."""
    import torch.distributed as dist
    from parts.comm import all_gather_objects
    from parts.comm.snapshot_files import job_folder, node_folder, side_name
    model, opt = _hybrid()
    snaps = _snaps(base, job, 2, shared).start()
    snaps.save(_state(model, opt), step=1)
    at_save = _current(model, opt)
    snaps.wait()
    root = Path(_root(base, 0 if shared else dist.get_rank() // 2))
    folder = node_folder(job_folder(root, job), dist.get_rank() // 2)
    side_bytes = (folder / "gen-00000001" / side_name(dist.get_rank())).stat().st_size
    node = dist.get_rank() // 2
    own_files_only = sorted(p.name for p in (folder / "gen-00000001").glob("*.distcp")) == \
        [f"__{r}_0.distcp" for r in (2 * node, 2 * node + 1)]
    all_gather_objects(None)
    if dist.get_rank() == 0 and damage_node_0:
        victim = folder / "gen-00000001" / "__0_0.distcp"
        os.truncate(victim, victim.stat().st_size // 2)
    elif dist.get_rank() == 0:
        shutil.rmtree(node_folder(job_folder(root, job), 1) if shared else _root(base, 1))
    all_gather_objects(None)
    fresh, fresh_opt = _hybrid()
    fresh_opt.step()  # other values than at the save
    state = _state(fresh, fresh_opt)
    again = _snaps(base, job, 2, shared)
    restored = again.restore(state)
    from parts.partition import load_sharded_optimizer_state_dict, load_sharded_state_dict
    load_sharded_state_dict(fresh, state["model"])
    load_sharded_optimizer_state_dict(fresh, fresh_opt, state["optim"])
    loaded = _current(fresh, fresh_opt)
    again.close()
    sent = snaps.sent_bytes == (0 if shared else side_bytes)
    return {"network": snaps.network, "node_checkpoints": snaps.node_checkpoints, "sent_only_own_values": sent,
            "own_files_only": own_files_only,
            "step": restored.step, "same": len(loaded) == len(at_save) and
            all(torch.equal(a, b) for a, b in zip(loaded, at_save)), "left": _left(base)}


@pytest.mark.parametrize("shared", [False, True])
def test_a_hybrid_layouts_nodes_each_hold_a_whole_snapshot_and_a_lost_node_comes_back_bitwise(tmp_path,
                                                                                             shared: bool) -> None:
    job = f"test-{uuid.uuid4().hex[:8]}"
    for rank, got in enumerate(run(4, hybrid_lose_node, str(tmp_path), job, shared, timeout=SLOW)):
        assert got == {"network": not shared, "node_checkpoints": True, "sent_only_own_values": True,
                       "own_files_only": True, "step": 1, "same": True, "left": []}, (rank, got)


def test_a_hybrid_layouts_damaged_node_copy_is_refused_and_the_other_replicas_copy_restored(tmp_path) -> None:
    job = f"test-{uuid.uuid4().hex[:8]}"
    for rank, got in enumerate(run(4, hybrid_lose_node, str(tmp_path), job, False, True, timeout=SLOW)):
        assert got == {"network": True, "node_checkpoints": True, "sent_only_own_values": True,
                       "own_files_only": True, "step": 1, "same": True, "left": []}, (rank, got)
