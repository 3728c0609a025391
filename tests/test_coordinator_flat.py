"""Persistent parameters in flat buffers (coordinator/flat.py): one collective each way per step,
the math and the bytes of the per-parameter path; modules inside a fetch unit carry no hooks."""

import torch
from harness import run

from parts.partition import meta, release, shards
from parts.partition.coordinator import attach
from test_coordinator_models import GPT, batch, full_params, make_pair, rank_info


def _train(threshold: int, skip_odd: bool = False) -> dict:
    """Four AdamW steps (all params persistent unless ``threshold`` is 0); between steps 2 and 3
    a persistent param is released (the flat buffer is put in place again); then two eval steps."""
    rank, world = rank_info()
    _, model = make_pair(GPT, skip_odd=skip_odd)
    co = attach(model, persistence_threshold=threshold)
    opt = torch.optim.AdamW(shards(model), lr=1e-2)
    out = dict(stats=[], grads_shared=[], unused_grad=[])
    for step in range(4):
        if step == 2:
            release([model.ln_f.weight])
        model(*batch(step, 2, rank * 2)).backward()
        grads = [meta(p).grad_shard for p in model.parameters()]
        live = [g for g in grads if g is not None]
        out["grads_shared"].append(len({g.untyped_storage().data_ptr() for g in live}))
        out["unused_grad"].append(meta(model.blocks[1].fc.weight).grad_shard is None)
        opt.step()
        opt.zero_grad()
        out["stats"].append(co.stats())
    model.eval()
    with torch.no_grad():
        for step in range(2):
            model(*batch(4 + step, 2, rank * 2))
            out["stats"].append(co.stats())
    full = [p.data.untyped_storage().data_ptr() for p in model.parameters()]
    out.update(params=full_params(model), full_shared=len(set(full)), n=len(full), world=world,
               shard_elems=sum(meta(p).layout.shard_numel for p in model.parameters()))
    co.detach()
    return out


def test_persistent_params_move_in_one_collective_each_way_with_the_same_math():
    for world in (1, 2):
        flat, per_unit = run(world, _train, 100_000)[0], run(world, _train, 0)[0]
        assert all(torch.equal(a, b) for a, b in zip(flat["params"], per_unit["params"]))
        w, elems = flat["world"], flat["shard_elems"]
        for k, s in enumerate(flat["stats"][:4]):  # every step: one all-gather, one reduce-scatter,
            # exact bytes; step 2 two all-gathers: step 1's refresh after its optimizer step, then
            # the buffer put in place again after the release
            gathers = 2 if k == 2 else 1
            assert (s.allgather_calls, s.reduce_scatter_calls) == (gathers, 1)
            assert s.persistent_gathers == gathers * flat["n"]
            assert s.allgather_bytes == gathers * s.reduce_scatter_bytes == gathers * (w - 1) * elems * 4
        # the full tensors are views of one buffer, the grad shards of another
        assert flat["full_shared"] == 1 and flat["grads_shared"] == [1] * 4
        first_eval, second_eval = flat["stats"][4:]  # after the last optimizer step: refreshed once
        assert first_eval.allgather_bytes == (w - 1) * elems * 4 and second_eval.allgather_bytes == 0
        # the same reduce-scatter bytes as fetch units without persistence
        assert [s.reduce_scatter_bytes for s in flat["stats"]] == \
            [s.reduce_scatter_bytes for s in per_unit["stats"]]


def test_a_persistent_param_without_grad_keeps_no_grad_shard():
    """Block 1 is skipped on odd steps: its params get no grad, so the flat reduce steps aside
    (the per-parameter path runs) and their grad shards stay None, as without persistence."""
    flat, per_unit = run(2, _train, 100_000, True)[0], run(2, _train, 0, True)[0]
    assert flat["unused_grad"] == per_unit["unused_grad"] == [False, True, False, True]
    assert all(torch.equal(a, b) for a, b in zip(flat["params"], per_unit["params"]))
    assert [s.reduce_scatter_bytes for s in flat["stats"]] == \
        [s.reduce_scatter_bytes for s in per_unit["stats"]]


def _hooks() -> dict:
    _, model = make_pair(GPT)
    co = attach(model)
    block = model.blocks[0]
    inner = list(block.modules())[1:]
    out = dict(unit=bool(block._forward_pre_hooks) and bool(block._forward_hooks),
               inner=[len(m._forward_pre_hooks) + len(m._forward_hooks) for m in inner])
    co.detach()
    out["checks_back"] = [len(m._forward_pre_hooks) for m in inner if m._parameters]
    return out


def test_modules_inside_a_fetch_unit_carry_no_forward_hooks():
    out = run(1, _hooks)[0]
    assert out["unit"] and out["inner"] == [0] * len(out["inner"])
    assert out["checks_back"] and all(n == 1 for n in out["checks_back"])  # detach: checks restored


def _micro_batches(threshold: int) -> tuple:
    rank, _ = rank_info()
    _, model = make_pair(GPT)
    co = attach(model, persistence_threshold=threshold)
    for i in range(3):  # three micro-batches: the flat grad shards are added to in one op
        model(*batch(i, 2, rank * 2)).backward()
    grads = [meta(p).grad_shard.clone() for p in model.parameters()]
    storages = {meta(p).grad_shard.untyped_storage().data_ptr() for p in model.parameters()}
    co.detach()
    return grads, len(storages)


def test_micro_batches_accumulate_into_the_flat_grad_shards_bitwise():
    (flat, n_flat), (per_unit, n_unit) = run(2, _micro_batches, 100_000)[0], run(2, _micro_batches, 0)[0]
    assert n_flat == 1 < n_unit
    assert all(torch.equal(a, b) for a, b in zip(flat, per_unit))
