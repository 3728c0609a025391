"""BF16Optimizer over bf16 shards on disk: its fp32 masters in the store too, bitwise the in-memory run."""

import pytest
import torch
import torch.distributed as dist

from harness import run
from test_offload_partition import KNOBS, _train
from test_coordinator_models import GPT
from parts.offload import DiskStore, OffloadedOptimizer, parking
from parts.optim import BF16Optimizer
from parts.partition import attach, detach, full_state_dict, partitioned
from parts.partition.core import disk


def _build(remote):
    torch.manual_seed(0)
    with partitioned(dtype=torch.bfloat16, remote_device=remote):
        return GPT(layers=2)


def _masters(opt):
    """Every sharded param's fp32 master, read back (from the store if it is there)."""
    out = []
    for group in opt.sharded_groups:
        for s in group:
            with disk.peek(s.master):
                out.append(s.master.clone())
    return out


def body_bf16_disk_equals_memory(tmp):
    rank = dist.get_rank()
    store = DiskStore(f"{tmp}/r{rank}", block_bytes=4096, max_inflight_bytes=1 << 16)
    ref, off = _build(None), _build(store)
    attach(ref, **KNOBS), attach(off, **KNOBS)
    ref_opt = BF16Optimizer(torch.optim.AdamW(ref.parameters(), lr=1e-2), clip_grad=0.05)
    inner = OffloadedOptimizer(torch.optim.AdamW(off.parameters(), lr=1e-2), store, chunk_bytes=6000)
    off_opt = BF16Optimizer(inner, clip_grad=0.05)
    parked = all(parking.parked(s.master) is not None and s.master.untyped_storage().nbytes() == 0
                 for g in off_opt.sharded_groups for s in g)
    ref_losses, off_losses = _train(ref, ref_opt, 3, rank), _train(off, off_opt, 3, rank)
    same_losses = all(torch.equal(a, b) for a, b in zip(ref_losses, off_losses))
    same_norm = ref_opt.last_grad_norm == off_opt.last_grad_norm
    clipped = ref_opt.last_grad_norm > 0.05
    same_masters = all(torch.equal(a, b) for a, b in zip(_masters(ref_opt), _masters(off_opt)))
    a, b = full_state_dict(ref), full_state_dict(off)
    same_params = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    masters_in_store = sum(k.startswith("master/") for k in store.keys())
    resident = sum(s.master.untyped_storage().nbytes() for g in off_opt.sharded_groups for s in g)
    detach(ref), detach(off)
    store.close()
    return (parked, same_losses, same_norm, clipped, same_masters, same_params, masters_in_store,
            resident, len(off_opt.sharded_groups[0]))


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_optimizer_masters_on_disk_equal_memory(tmp_path, world):
    for r in run(world, body_bf16_disk_equals_memory, str(tmp_path)):
        parked, same_losses, same_norm, clipped, same_masters, same_params, in_store, resident, n = r
        assert parked and clipped  # masters start in the store; the clip coefficient is < 1
        assert same_losses and same_norm and same_masters and same_params
        assert in_store == n and resident == 0


def body_plain_inner_refused(tmp):
    store = DiskStore(f"{tmp}/r{dist.get_rank()}")
    model = _build(store)
    try:
        BF16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    except TypeError as e:
        return str(e)
    finally:
        store.close()
    return "no error"


def test_bf16_over_disk_shards_needs_offloaded_inner(tmp_path):
    message = run(1, body_plain_inner_refused, str(tmp_path))[0]
    assert "has its shard in a DiskStore" in message and "OffloadedOptimizer(" in message
