"""OffloadedOptimizer: bitwise the in-memory optimizer, its state in a DiskStore between steps."""

import copy
import gc

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st
from torch import nn

from harness import run
from parts.offload import DiskStore, OffloadedOptimizer, plan_chunks
from parts.offload import parking
from parts.offload.optimizer import AHEAD_CHUNKS

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
}


@settings(max_examples=50, deadline=None)
@given(costs=st.lists(st.integers(0, 100), max_size=30), budget=st.integers(1, 150))
def test_plan_chunks_covers_in_order_within_budget(costs, budget):
    chunks = plan_chunks(costs, budget)
    assert [i for c in chunks for i in c] == list(range(len(costs)))
    for c in chunks:
        assert len(c) == 1 or sum(costs[i] for i in c) <= budget
    for a, b in zip(chunks, chunks[1:]):  # greedy: the next item did not fit
        assert sum(costs[i] for i in a) + costs[b[0]] > budget


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(9, 33), nn.Tanh(), nn.Linear(33, 17), nn.Tanh(), nn.Linear(17, 3))


def _loss(model, step):
    g = torch.Generator().manual_seed(step)
    return model(torch.randn(8, 9, generator=g)).square().mean()


def _train(model, opt, sched, steps, frozen_at=None):
    for step in range(steps):
        _loss(model, step).backward()
        if step == frozen_at:
            model[2].weight.grad = None  # a param without a grad this step is left alone
        opt.step()
        sched.step()
        opt.zero_grad()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_bitwise_in_memory_with_scheduler_and_state_dict(tmp_path, name):
    ref, off = _model(), _model()
    ref_opt = OPTIMIZERS[name](ref.parameters())
    with DiskStore(tmp_path, block_bytes=4096) as store:
        opt = OffloadedOptimizer(OPTIMIZERS[name](off.parameters()), store, chunk_bytes=2000)
        scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.7) for o in (ref_opt, opt)]
        _train(ref, ref_opt, scheds[0], 4, frozen_at=1)
        _train(off, opt, scheds[1], 4, frozen_at=1)
        for a, b in zip(ref.parameters(), off.parameters()):
            assert torch.equal(a, b)
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] != 1e-2
        big = [k for k, v in opt.state[off[0].weight].items() if v.shape == off[0].weight.shape]
        assert big == [] and any(k.startswith("optim/0/") for k in store.keys())
        _same_state(ref_opt.state_dict(), opt.state_dict())
        # a fresh wrapper loading that state dict continues exactly like the reference
        again = copy.deepcopy(off)
        opt2 = OffloadedOptimizer(OPTIMIZERS[name](again.parameters()), store, chunk_bytes=700,
                                  prefix="second")
        opt2.load_state_dict(opt.state_dict())
        sched2 = torch.optim.lr_scheduler.StepLR(opt2, 1, gamma=0.7)
        sched2.load_state_dict(scheds[1].state_dict())
        _train(ref, ref_opt, scheds[0], 2)
        _train(again, opt2, sched2, 2)
        for a, b in zip(ref.parameters(), again.parameters()):
            assert torch.equal(a, b)


def _same_state(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"])
    for i, st_a in a["state"].items():
        assert sorted(st_a) == sorted(b["state"][i])
        for k, v in st_a.items():
            assert torch.equal(v, b["state"][i][k]) if isinstance(v, torch.Tensor) else v == b["state"][i][k]


@pytest.mark.parametrize("across_steps", [True, False])
def test_parked_params_and_grads_step_from_the_store(tmp_path, across_steps):
    """Parameters parked on disk with their (accumulated) grads in the store: same as in memory.
    Across steps, the last chunk (the fifth tensor) stays loaded while its writes are behind."""
    ref = [torch.randn(1000 + 7 * i, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    off = [t.clone() for t in ref]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    with DiskStore(tmp_path, block_bytes=4096) as store:
        for i, t in enumerate(off):
            parking.park(t, store, f"p{i}")
        assert all(t.untyped_storage().nbytes() == 0 for t in off)
        opt = OffloadedOptimizer(torch.optim.AdamW(off, lr=1e-2), store, chunk_bytes=40_000,
                                 across_steps=across_steps)
        for step in range(3):
            for micro in range(2):
                for i, (r, o) in enumerate(zip(ref, off)):
                    g = torch.randn(r.shape, generator=torch.Generator().manual_seed(100 * step + 10 * micro + i))
                    r.grad = g.clone() if r.grad is None else r.grad.add_(g)
                    parking.accumulate_grad(o, g, accumulate=micro > 0)
            ref_opt.step()
            ref_opt.zero_grad()
            opt.step()
            opt.zero_grad()
            loaded = [t.untyped_storage().nbytes() > 0 for t in off]
            assert loaded == [False] * 4 + [across_steps]
            opt.settle()
            assert all(t.untyped_storage().nbytes() == 0 and t.grad is None for t in off)
            assert not any(parking.has_grad(t) for t in off)
        for r, o in zip(ref, off):
            parking.load(o)
            assert torch.equal(r, o) and parking.version(o) == 3


def body_sharded(name, tmp):
    """World 2: the shards of a partitioned model stepped in memory and offloaded, bitwise."""
    from parts.partition import gathered, partition_module, reduce_scatter_grads, shards
    rank = dist.get_rank()
    models = [partition_module(_model(3)), partition_module(_model(3))]
    plain = OPTIMIZERS[name](shards(models[0]))
    store = DiskStore(f"{tmp}/rank{rank}", block_bytes=4096)
    off = OffloadedOptimizer(OPTIMIZERS[name](shards(models[1])), store, chunk_bytes=3000)
    for step in range(3):
        for model, opt in zip(models, (plain, off)):
            with gathered(model.parameters()):
                _loss(model, 10 * step + rank).backward()
                reduce_scatter_grads(model.parameters())
            opt.step()
            opt.zero_grad()
    same = all(torch.equal(a, b) for a, b in zip(shards(models[0]), shards(models[1])))
    keys = len(store.keys())
    store.close()
    return same, keys


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_world2_shards_bitwise(tmp_path, name):
    out = run(2, body_sharded, name, str(tmp_path))
    assert all(same for same, _ in out) and all(keys >= 6 for _, keys in out)


def test_two_optimizers_on_one_prefix_of_a_store_raise(tmp_path):
    """A second OffloadedOptimizer on the same store and prefix would overwrite the first one's
    state tensors (same keys), so it raises naming the prefix; another prefix, or the same
    prefix once the first optimizer is gone, works."""
    store = DiskStore(str(tmp_path))
    first_model, second_model = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    first = OffloadedOptimizer(torch.optim.Adam(first_model.parameters()), store)
    with pytest.raises(ValueError, match="key prefix 'optim' belongs to a live OffloadedOptimizer"):
        OffloadedOptimizer(torch.optim.Adam(second_model.parameters()), store)
    OffloadedOptimizer(torch.optim.Adam(second_model.parameters()), store, prefix="second")
    del first
    gc.collect()
    OffloadedOptimizer(torch.optim.Adam(second_model.parameters()), store)
    store.close()


@pytest.mark.parametrize("across_steps", [False, True])
def test_later_chunks_read_into_the_buffers_of_finished_ones(tmp_path, across_steps):
    """Eight 64 KiB layers, one per chunk: from the fourth chunk on, a chunk's AdamW state is read
    into the buffers chunk k-3 gave back (its writes done), and the spares stay from one step to
    the next, so from the third step on every state read lands in memory touched before (step 1
    reads no state; in step 2 the first three chunks' reads are fresh, less the chunks read ahead
    into spares across steps). Spares plus buffers lent never exceed three chunks'
    state; the result stays bitwise the plain optimizer's."""
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Linear(128, 128, bias=False) for _ in range(8)])
    off = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    layer = 128 * 128 * 4
    with DiskStore(tmp_path) as store:
        opt = OffloadedOptimizer(torch.optim.AdamW(off.parameters(), lr=1e-2), store,
                                 chunk_bytes=4 * layer, across_steps=across_steps)
        reused, held = [], []
        opt.after_step.append(lambda chunk: held.append(opt.spares.held_bytes))
        for step in range(4):
            for model, o in ((ref, ref_opt), (off, opt)):
                g = torch.Generator().manual_seed(step)
                model(torch.randn(4, 128, generator=g)).square().mean().backward()
                before = opt.spares.reused
                o.step()
                o.zero_grad()
            reused.append(opt.spares.reused - before)
            assert 0 < opt.spares.held_bytes <= 3 * 2 * layer or step == 0
        carried = 2 * AHEAD_CHUNKS if across_steps else 0
        assert reused == [0, 2 * (8 - 3) + carried, 2 * 8, 2 * 8]
        assert max(held) <= 3 * 2 * layer  # inside the steps too (after each chunk's step)
        opt.settle()  # waits the writes behind, drops the reads ahead: what they held is spare now
        assert opt.spares.held_bytes == opt.spares.spare_bytes <= 3 * 2 * layer
        opt.spares.clear()
        assert opt.spares.held_bytes == 0
        for a, b in zip(ref.parameters(), off.parameters()):
            assert torch.equal(a, b)
        for p, q in zip(ref.parameters(), off.parameters()):
            state = opt.state_of(q)
            assert all(torch.equal(ref_opt.state[p][k], state[k]) for k in ("exp_avg", "exp_avg_sq"))
