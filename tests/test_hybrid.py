"""Hybrid layouts (shards on a shard group, replicated across a replica group) train like full
sharding and like plain torch; norms count each element once; checkpoints cross layouts."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from harness import run

STEPS, LR = 3, 0.1


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _batches(steps: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)) for _ in range(steps)]


def _mesh(replicas: int):
    """A (replicate, shard) mesh of the world; None for full sharding."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    if replicas is None:
        return None
    return init_device_mesh("cpu", (replicas, dist.get_world_size() // replicas),
                            mesh_dim_names=("replicate", "shard"))


def _layout(replicas) -> dict:
    """``partitioned`` arguments: a mesh, or ("groups") the 2 x 2 layout as two explicit groups."""
    import torch.distributed as dist
    if replicas == "nodes":  # full sharding over 2 nodes of 2 ranks: all-gathers in two hops
        return {"ranks_per_node": 2}
    if replicas == "flat":  # every collective over the 4 ranks at once, wherever they run
        return {"ranks_per_node": 1}
    if replicas != "groups":
        return {"mesh": _mesh(replicas)}
    rank = dist.get_rank()
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return {"group": rows[rank // 2], "replicate_group": columns[rank % 2]}


def _reference(steps: int, micro: int, world: int, clip: float = 0.0) -> tuple[dict, list[float]]:
    """Plain torch on the whole batch: rank 0's initial values, SGD; the state and the grad norms."""
    torch.manual_seed(100)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for x, y in _batches(steps, 2 * micro * world):
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip if clip else 1e9)))
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}, norms


def _train(replicas, steps: int = STEPS, micro: int = 1, sync: str = "step", clip: float = 0.0):
    """Train on this rank's rows of each batch (``micro`` micro-batches of 2 rows); the full
    state on rank 0, the grad norms, and the cross-replica all-reduce bytes per group. ``sync``:
    "step" or "backward" (``set_replica_sync``), "default" (nothing said), "no_sync" (the
    default, every micro-batch but the last under ``no_sync``)."""
    import contextlib
    import torch.distributed as dist
    from parts.comm import comm_counter
    from parts.comm.counter import ledger_since
    from parts.partition import attach, clip_grad_norm_, full_state_dict, no_sync, partitioned, set_replica_sync, shards
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)  # every rank seeds differently: all start from rank 0's values
    with partitioned(**_layout(replicas)):
        model = _model()
    coordinator = attach(model, persistence_threshold=100)
    if sync in ("step", "backward"):
        set_replica_sync(coordinator, sync)
    opt = torch.optim.SGD(shards(model), lr=LR)
    before, norms = comm_counter.by_group(), []
    for x, y in _batches(steps, 2 * micro * world):
        xs, ys = x.chunk(world * micro), y.chunk(world * micro)
        for k in range(micro):
            i = rank * micro + k
            deferred = sync == "no_sync" and k < micro - 1
            with no_sync(model) if deferred else contextlib.nullcontext():
                (nn.functional.mse_loss(model(xs[i]), ys[i]) / micro).backward()
        norms.append(float(clip_grad_norm_(model, clip if clip else 1e9)))
        opt.step()
        opt.zero_grad()
    ledger = ledger_since(before, comm_counter.by_group())
    return full_state_dict(model, rank0_only=False), norms, ledger, coordinator.stats().bytes_by_group


def test_hybrid_layouts_equal_full_sharding_and_plain_torch():
    ref, ref_norms = _reference(STEPS, 1, 4)
    full = run(4, _train, None)[0]
    for replicas in (2, 4):  # 2 x 2 and 4 x 1 (1 x 4 is full sharding itself: the mesh path)
        ranks = run(4, _train, replicas)
        hybrid = ranks[0]
        for other in ranks[1:]:  # replicas stay bitwise identical
            assert all(torch.equal(other[0][k], hybrid[0][k]) for k in hybrid[0])
        for k in ref:  # the mean runs as a sum over each group, then over replicas: a few ulps apart
            torch.testing.assert_close(hybrid[0][k], full[0][k], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(hybrid[0][k], ref[k], rtol=1e-5, atol=1e-6)
        assert hybrid[1] == hybrid[1] and all(abs(a - b) < 1e-5 * b for a, b in zip(hybrid[1], ref_norms))
        if replicas == 2:  # explicit groups are the mesh's, and the mean overlapped with backward: bitwise
            groups = run(4, _train, "groups")[0]
            overlapped = run(4, _train, 2, sync="default")[0]
            assert all(torch.equal(groups[0][k], hybrid[0][k]) for k in ref)
            assert all(torch.equal(overlapped[0][k], hybrid[0][k]) for k in ref)
    one_by_four = run(4, _train, 1)[0]
    for k in ref:  # a mesh of one replica is full sharding: bitwise
        assert torch.equal(one_by_four[0][k], full[0][k])


def _overlapping_groups() -> str:
    import torch.distributed as dist
    from parts.partition import partitioned
    everyone = dist.new_group([0, 1])
    try:
        with partitioned(group=everyone, replicate_group=everyone):
            _model()
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_replicate_group_overlapping_the_shard_group_is_refused_naming_both():
    message = run(2, _overlapping_groups)[0]
    assert "replicate group" in message and "[0, 1]" in message


def test_norms_agree_on_every_rank_and_with_the_unsharded_norm():
    ref, ref_norms = _reference(STEPS, 1, 4, clip=0.05)
    out = run(4, _train, 2, clip=0.05)
    assert all(o[1] == out[0][1] for o in out)  # every rank the same norm, bitwise
    for a, b in zip(out[0][1], ref_norms):  # not over-counted by the replica factor
        assert abs(a - b) <= 1e-5 * b
    for k in ref:
        torch.testing.assert_close(out[0][0][k], ref[k], rtol=1e-5, atol=1e-6)


def test_accumulation_under_no_sync_means_once_per_step_bitwise_as_the_step_mode():
    micro = 4
    ref, _ = _reference(2, micro, 4)
    deferred = run(4, _train, 2, steps=2, micro=micro)  # set_replica_sync(model, "step")
    eager = run(4, _train, 2, steps=2, micro=micro, sync="default")  # nothing said: a mean per micro-batch
    told = run(4, _train, 2, steps=2, micro=micro, sync="no_sync")
    for k in ref:
        torch.testing.assert_close(deferred[0][0][k], ref[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(eager[0][0][k], deferred[0][0][k], rtol=1e-6, atol=1e-7)
        assert torch.equal(told[0][0][k], deferred[0][0][k])
    replica_group = "0,2"  # rank 0's column of the 2 x 2 mesh
    per_step = deferred[0][2][replica_group]["all_reduce_bytes"] / 2  # across replicas
    assert per_step == 4 * sum(-(-v.numel() // 2) for v in ref.values())  # each fp32 grad shard once
    assert told[0][2][replica_group]["all_reduce_bytes"] / 2 == per_step
    assert eager[0][2][replica_group]["all_reduce_bytes"] / 2 == micro * per_step
    calls = told[0][2][replica_group]["all_reduce_calls"]  # the last backward's buckets, once per step
    assert calls * micro == eager[0][2][replica_group]["all_reduce_calls"]
    step = deferred[0][3]  # stats() of the last micro-batch: gathers and reduce-scatters in the
    assert step["0,1"]["allgather_bytes"] > 0 and step["0,1"]["reduce_scatter_bytes"] > 0  # shard group
    checks = {"check_bytes", "check_calls"}  # the end-of-backward agreement on which grads ran (uneven.py)
    assert set(step.get(replica_group, {})) <= checks  # no mean crossed replicas since the micro-batch before
    assert set(told[0][3][replica_group]) == {"all_reduce_bytes", "all_reduce_calls"} | checks  # in the last backward


def _dcp_round(path: str, replicas, save: bool) -> dict:
    """Build the model (rank 0's seed differs from the saver's), save or load its sharded state
    through DCP at this layout, return its full state."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from parts.partition import full_state_dict, load_sharded_state_dict, partitioned, sharded_state_dict
    torch.manual_seed(100 + dist.get_rank() + (0 if save else 50))
    with partitioned(mesh=_mesh(replicas)):
        model = _model()
    state = sharded_state_dict(model)
    if save:
        dcp.save(state, checkpoint_id=path)
    else:
        dcp.load(state, checkpoint_id=path)
        load_sharded_state_dict(model, state)
    return full_state_dict(model, rank0_only=False)


def _data_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix == ".distcp")


def test_dcp_hybrid_checkpoint_writes_each_shard_once_and_loads_fully_sharded_and_back(tmp_path):
    hybrid, full = tmp_path / "hybrid", tmp_path / "full"
    saved = run(4, _dcp_round, str(hybrid), 2, True)
    run(2, _dcp_round, str(full), None, True)
    assert _data_bytes(hybrid) == _data_bytes(full)  # each shard once, not once per replica
    loaded = run(2, _dcp_round, str(hybrid), None, False)  # hybrid 2 x 2 -> full sharding at world 2
    back = run(4, _dcp_round, str(full), 2, False)  # full sharding at world 2 -> hybrid 2 x 2
    reference = run(2, _dcp_round, str(full), None, False)[0]
    for k in saved[0]:
        assert all(torch.equal(r[k], saved[0][k]) for r in saved + loaded)
        assert all(torch.equal(r[k], reference[k]) for r in back)


def _bf16_norms(replicas) -> tuple[list[float], dict]:
    """BF16Optimizer (clipping) over a bf16 model in this layout: its grad norms and full state."""
    import torch.distributed as dist
    from parts.optim import BF16Optimizer
    from parts.partition import attach, full_state_dict, partitioned
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)
    mesh = _mesh(replicas)
    with partitioned(mesh=mesh, dtype=torch.bfloat16):
        model = _model()
    attach(model, persistence_threshold=100)
    group = mesh.get_group(1) if mesh is not None else None
    opt = BF16Optimizer(torch.optim.SGD(model.parameters(), lr=LR), group=group, clip_grad=0.05)
    norms = []
    for x, y in _batches(2, 2 * world):
        i = slice(2 * rank, 2 * rank + 2)
        nn.functional.mse_loss(model(x[i].bfloat16()).float(), y[i]).backward()
        opt.step()
        opt.zero_grad()
        norms.append(opt.last_grad_norm)
    return norms, full_state_dict(model, rank0_only=False)


def test_bf16_optimizer_norm_of_a_hybrid_layout_equals_full_sharding_on_every_rank():
    full = run(4, _bf16_norms, None)
    hybrid = run(4, _bf16_norms, 2)
    assert all(h[0] == hybrid[0][0] for h in hybrid)  # every rank the same norm, bitwise
    for a, b in zip(hybrid[0][0], full[0][0]):  # once per element, not once per replica
        assert abs(a - b) <= 1e-5 * b
    for k, v in full[0][1].items():  # fp32 sums in another order, then bf16 weights: one bf16 ulp
        torch.testing.assert_close(hybrid[0][1][k].float(), v.float(), rtol=8e-3, atol=1e-5)


def _ledger_and_totals() -> tuple[dict, dict]:
    import torch.distributed as dist
    from parts.comm import all_reduce, comm_counter, group_info
    sub = dist.new_group([0, 1])
    comm_counter.reset()
    all_reduce(torch.ones(10), group_info(None))
    if dist.get_rank() < 2:
        all_reduce(torch.ones(6), group_info(sub))
    return comm_counter.by_group(), comm_counter.snapshot()


def test_ledger_per_group_adds_up_to_the_totals():
    out = run(3, _ledger_and_totals)
    ledger, totals = out[0]
    assert ledger == {"0,1,2": {"all_reduce_bytes": 2 * 2 * 10 * 4 // 3, "all_reduce_calls": 1},
                      "0,1": {"all_reduce_bytes": 2 * 1 * 6 * 4 // 2, "all_reduce_calls": 1}}
    assert totals["all_reduce_bytes"] == sum(row["all_reduce_bytes"] for row in ledger.values())
    assert "0,1" not in out[2][0]


class _Reinit(nn.Module):
    """A parent that re-initialises its children after they were sharded (as nanoGPT does)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()
        self.apply(lambda m: nn.init.normal_(m.weight, std=0.5) if isinstance(m, nn.Linear) else None)


def _reinit_state() -> dict:
    import torch.distributed as dist
    from parts.partition import full_state_dict, partitioned
    torch.manual_seed(100 + dist.get_rank())
    with partitioned(mesh=_mesh(2)):
        model = _Reinit()
    return full_state_dict(model, rank0_only=False)


def test_init_code_under_a_hybrid_layout_gives_rank_0s_values_on_every_replica():
    torch.manual_seed(100)
    plain = _Reinit().state_dict()
    for state in run(4, _reinit_state):
        assert state.keys() == plain.keys()
        assert all(torch.equal(state[k], plain[k]) for k in plain)


def test_two_hop_collectives_equal_flat_ones_and_cross_nodes_half_as_much():
    flat = run(4, _train, None)[0]
    hops = run(4, _train, "nodes")[0]
    for k in flat[0]:  # all-gathers only move bytes; the sums run in another order: a few ulps
        torch.testing.assert_close(hops[0][k], flat[0][k], rtol=1e-6, atol=1e-7)
    for kind in ("allgather_bytes", "reduce_scatter_bytes"):
        crossing = hops[2]["0,2"][kind]  # rank 0's node is {0, 1}; {0, 2} crosses
        assert hops[2]["0,1"][kind] == 2 * crossing  # the node hop carries the rest
        assert 3 * crossing == flat[2]["0,1,2,3"][kind]  # flat: 2 of its 3 pieces cross


def _load_on_rank_0(state: dict) -> dict:
    """A hybrid model (every rank seeded apart) loads ``state`` given on global rank 0 only."""
    import torch.distributed as dist
    from parts.partition import full_state_dict, load_full_state_dict, partitioned
    torch.manual_seed(300 + dist.get_rank())
    with partitioned(mesh=_mesh(2)):
        model = _model()
    load_full_state_dict(model, state if dist.get_rank() == 0 else None)
    return full_state_dict(model, rank0_only=False)


def test_a_full_state_dict_given_on_rank_0_loads_into_every_replica():
    torch.manual_seed(5)
    state = _model().state_dict()
    for loaded in run(4, _load_on_rank_0, state):
        assert all(torch.equal(loaded[k], state[k]) for k in state)


def _train_as_launched(ranks_per_node, local: int):
    """``_train`` of full sharding under a launcher that put ``local`` ranks on each node."""
    import os
    before = os.environ["LOCAL_WORLD_SIZE"]
    os.environ["LOCAL_WORLD_SIZE"] = str(local)
    try:
        return _train(None if ranks_per_node is None else "flat" if ranks_per_node == 1 else "nodes")
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = before


def test_full_sharding_over_launched_nodes_goes_in_two_hops_by_default_and_flat_when_told():
    default, told, flat = (run(4, _train_as_launched, k, 2)[0] for k in (None, 2, 1))
    assert default[2] == told[2]  # the ledgers: the launcher's 2 ranks per node, as if given
    assert all(torch.equal(default[0][k], told[0][k]) for k in told[0])
    assert "0,2" not in flat[2] and flat[2]["0,1,2,3"] == run(4, _train, None)[0][2]["0,1,2,3"]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 6), st.integers(0, 3), st.integers(1, 8))
def test_launcher_nodes_are_whole_aligned_blocks_of_two_or_more(k, nodes, first, guess):
    from parts.comm.topology import node_blocks
    ranks = list(range(first * k, (first + nodes) * k))
    assert node_blocks(ranks, k) == (k >= 2 and nodes >= 2)
    if k >= 2 and nodes >= 2:
        assert not node_blocks(ranks[1:] + [ranks[-1] + 1], k)  # shifted off the node boundaries
        assert node_blocks(ranks, guess) == (guess >= 2 and len(ranks) % guess == 0
                                             and len(ranks) > guess and ranks[0] % guess == 0)


def _built(differ: str) -> tuple[dict, dict]:
    """A model built on a 2 x 2 mesh, every rank from one seed ("none"), the second replica's last
    layer from another ("last"), or every rank from its own ("all"): the build's bytes per group
    and the full state."""
    import torch.distributed as dist
    from parts.comm import comm_counter
    from parts.comm.counter import ledger_since
    from parts.partition import full_state_dict, partitioned
    rank = dist.get_rank()
    before = comm_counter.by_group()
    torch.manual_seed(100 + rank if differ == "all" else 100)
    with partitioned(mesh=_mesh(2)):
        first, second = nn.Linear(16, 64), nn.Linear(64, 4)
        if differ == "last" and rank >= 2:
            torch.manual_seed(5)
        model = nn.Sequential(first, second, nn.Linear(4, 3))
    return ledger_since(before, comm_counter.by_group()), full_state_dict(model, rank0_only=False)


def _setups() -> dict:
    return {differ: _built(differ) for differ in ("none", "last", "all")}


def test_replicas_that_agree_send_only_checksums_at_setup_and_those_that_differ_take_the_first_replicas():
    from parts.base.layout import ShardLayout
    torch.manual_seed(100)
    plain = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 4), nn.Linear(4, 3)).state_dict()
    ranks = run(4, _setups)
    sent = {differ: ranks[0][differ][0]["0,2"] for differ in ranks[0]}  # rank 0's column crosses replicas
    shard_bytes = {k: 4 * (lambda r: r[1] - r[0])(ShardLayout(v.numel(), 2).range(0)) for k, v in plain.items()}
    assert sent["none"].get("broadcast_bytes", 0) == 0
    assert sent["none"]["allgather_bytes"] <= 3 * 2 * 2 * 8 + 3 * 8  # two checksums per tensor and an id per call
    assert sent["last"]["broadcast_bytes"] == shard_bytes["2.weight"] + shard_bytes["2.bias"]
    assert sent["all"]["broadcast_bytes"] == sum(shard_bytes.values())
    for rank in ranks:
        for differ, (_, state) in rank.items():
            assert all(torch.equal(state[k], plain[k]) for k in plain), differ


@settings(max_examples=50, deadline=None)
@given(st.binary(min_size=1, max_size=3000), st.data())
def test_a_checksum_is_a_function_of_the_bytes_and_sees_a_changed_or_swapped_byte(data, draw):
    from parts.comm.agreeing import checksum
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert torch.equal(checksum(raw), checksum(raw.clone()))
    off = draw.draw(st.integers(0, min(7, len(data) - 1)))  # a view that starts off a word boundary
    assert torch.equal(checksum(raw[off:]), checksum(raw[off:].clone()))
    i = draw.draw(st.integers(0, len(data) - 1))
    changed = raw.clone()
    changed[i] ^= draw.draw(st.integers(1, 255))
    assert not torch.equal(checksum(changed), checksum(raw))
    j = draw.draw(st.integers(0, len(data) - 1))
    swapped = raw.clone()
    swapped[i], swapped[j] = raw[j], raw[i]
    assert torch.equal(checksum(swapped), checksum(raw)) == bool(raw[i] == raw[j])
