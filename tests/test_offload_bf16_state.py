"""BF16Optimizer's checkpoints with its fp32 masters and state on disk: bitwise the in-memory ones.

``state_dict()``, ``consolidated_state_dict()``, ``full_fp32_param`` / ``full_state`` /
``full_grad`` of an offloaded ``BF16Optimizer(OffloadedOptimizer(...))`` equal the in-memory
optimizer's; loading either kind of dict (saved in memory or on disk) into a fresh offloaded
optimizer continues bitwise like the run that saved it. The memory bound of these calls is
measured in ``test_offload_state_dict_memory.py``.
"""

import pytest
import torch
import torch.distributed as dist

from harness import run
from test_coordinator_models import GPT, batch
from test_offload_partition import KNOBS, _train
from parts.comm import all_gather_objects, broadcast_object
from parts.offload import DiskStore, OffloadedOptimizer
from parts.optim import BF16Optimizer
from parts.partition import attach, detach, full_state_dict, partitioned


def _same(a, b):
    """Deep equality: same structure, tensors bitwise with the same dtype and shape."""
    if isinstance(a, dict):
        return isinstance(b, dict) and sorted(a) == sorted(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _system(tmp, name, seed, offload):
    """A 2-layer bf16 GPT and its BF16Optimizer: in memory, or shards, masters and state on disk."""
    store = DiskStore(f"{tmp}/r{dist.get_rank()}/{name}", block_bytes=4096) if offload else None
    torch.manual_seed(seed)
    with partitioned(dtype=torch.bfloat16, remote_device=store):
        model = GPT(layers=2)
    attach(model, **KNOBS)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if offload:
        inner = OffloadedOptimizer(inner, store, chunk_bytes=6000)
    return model, BF16Optimizer(inner, clip_grad=0.05), store


def _full_views(opt, model, rank):
    """full_fp32_param, full_state (exp_avg, step) and full_grad of every parameter (collectives)."""
    model(*batch(7, 4, 8 * rank)).backward()  # grads for full_grad; no step
    out = [(opt.full_fp32_param(p), opt.full_state(p, "exp_avg"), opt.full_state(p, "step"),
            opt.full_grad(p)) for p in model.parameters()]
    opt.zero_grad()
    return out


def body_round_trip(tmp):
    rank = dist.get_rank()
    ref, ref_opt, _ = _system(tmp, "ref", 0, False)
    off, off_opt, store = _system(tmp, "off", 0, True)
    _train(ref, ref_opt, 2, rank), _train(off, off_opt, 2, rank)
    off_opt.optimizer.settle()  # the last chunk's masters stay loaded until their writes behind are done
    resident = sum(s.master.untyped_storage().nbytes() for g in off_opt.sharded_groups for s in g)
    rank_sd, cons = ref_opt.state_dict(), ref_opt.consolidated_state_dict()
    checks = dict(in_store=resident == 0 and any(k.startswith("optim/") for k in store.keys()),
                  rank_dict=_same(rank_sd, off_opt.state_dict()),
                  consolidated=_same(cons, off_opt.consolidated_state_dict()),
                  full_views=_same(_full_views(ref_opt, ref, rank), _full_views(off_opt, off, rank)))
    # fresh offloaded systems (other initial weights) load the in-memory consolidated dict and
    # the offloaded run's rank dicts; all continue like the runs that saved them
    from_memory, mem_opt, _ = _system(tmp, "from_memory", 1, True)
    from_disk, disk_opt, _ = _system(tmp, "from_disk", 2, True)
    mem_opt.load_state_dict(broadcast_object(cons))
    disk_opt.load_state_dict(all_gather_objects(off_opt.state_dict()))
    checks["loaded"] = _same(disk_opt.state_dict(), rank_sd) and _same(mem_opt.state_dict(), rank_sd)
    losses = [_train(m, o, 2, rank) for m, o in ((ref, ref_opt), (off, off_opt),
                                               (from_memory, mem_opt), (from_disk, disk_opt))]
    checks["losses"] = all(_same(losses[0], other) for other in losses[1:])
    params = [full_state_dict(m) for m in (ref, off, from_memory, from_disk)]
    checks["params"] = all(_same(params[0], other) for other in params[1:])
    checks["after"] = _same(ref_opt.state_dict(), disk_opt.state_dict())
    for m in (ref, off, from_memory, from_disk):
        detach(m)
    return checks


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_bf16_offloaded_state_dicts_equal_memory_and_round_trip(tmp_path, world):
    for checks in run(world, body_round_trip, str(tmp_path), timeout=120.0):
        assert all(checks.values()), checks
