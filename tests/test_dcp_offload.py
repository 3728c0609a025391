"""Sharded DCP checkpoints of shards on disk (partitioned(remote_device=DiskStore)): model,
OffloadedOptimizer and BF16Optimizer state read from and written to the store one tensor at
a time; the checkpoints are bitwise those of the in-memory run, across world sizes both ways."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from harness import run
from test_dcp import ROWS, SLOW, peak_growth

STEPS = 2


def _model(kind: str, store) -> torch.nn.Module:
    """The same small model in memory (store None) or with its shards on disk."""
    from parts.partition import partition_module, partitioned
    torch.manual_seed(0)
    if kind == "adam":
        with partitioned(remote_device=store):
            return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.LayerNorm(9), torch.nn.Tanh(),
                                       torch.nn.Linear(9, 4))
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.LayerNorm(9), torch.nn.Tanh(), torch.nn.Linear(9, 4))
    partition_module(model[0], remote_device=store)
    partition_module(model[3], remote_device=store)  # the LayerNorm stays replicated: a flat group
    return model


def _optimizer(kind: str, model: torch.nn.Module, store):
    """Adam over shards, or BF16Optimizer over AdamW; state in ``store`` (OffloadedOptimizer) if given."""
    from parts.offload import OffloadedOptimizer
    from parts.optim import BF16Optimizer
    from parts.partition import shards
    if kind == "adam":
        inner = torch.optim.Adam(shards(model), lr=1e-2)
        return inner if store is None else OffloadedOptimizer(inner, store, chunk_bytes=256)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if store is not None:
        inner = OffloadedOptimizer(inner, store, chunk_bytes=256)
    return BF16Optimizer(inner, allow_fp32=True, named_parameters=model.named_parameters())


def _train(model, opt, steps: int) -> None:
    import torch.distributed as dist
    from parts.partition import gathered, is_partitioned, reduce_scatter_grads
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(5)
    sharded = [p for p in model.parameters() if is_partitioned(p)]
    for _ in range(steps):
        x, y = torch.randn(ROWS, 6, generator=generator), torch.randn(ROWS, 4, generator=generator)
        with gathered(sharded):
            loss = torch.nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
            loss.backward()
            reduce_scatter_grads(sharded)
        opt.step()
        opt.zero_grad()


def checkpoint(kind: str, on_disk: bool, scratch: str, out: str, source: str = "") -> int:
    """Build (on disk or in memory), train STEPS steps or load ``source``, save to ``out`` with DCP;
    returns the bytes of parameter shards and state held in memory on this rank (0 on disk)."""
    import torch.distributed as dist
    from parts.comm import dcp
    from parts.offload import DiskStore
    from parts.partition import (is_partitioned, load_sharded_optimizer_state_dict, load_sharded_state_dict,
                                 meta, sharded_optimizer_state_dict, sharded_state_dict)
    store = DiskStore(f"{scratch}/store-{dist.get_world_size()}-{dist.get_rank()}") if on_disk else None
    model = _model(kind, store)
    opt = _optimizer(kind, model, store)

    def state() -> dict:
        return {"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, opt)}
    if source:
        loaded = state()
        dcp.load(loaded, checkpoint_id=source)
        load_sharded_state_dict(model, loaded["model"])
        load_sharded_optimizer_state_dict(model, opt, loaded["optim"])
    else:
        _train(model, opt, STEPS)
    dcp.save(state(), checkpoint_id=out)
    held = sum(meta(p).shard.untyped_storage().nbytes() for p in model.parameters() if is_partitioned(p))
    if store is not None:
        store.close()
    return held


def _flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


def _consolidated(path: Path) -> dict:
    """Every key of a DCP checkpoint, in one process (torch's dcp_to_torch_save)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(path, path.with_suffix(".pt"))
    return _flat(torch.load(path.with_suffix(".pt"), weights_only=False))


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


@pytest.mark.parametrize("kind", ["adam", "bf16"])
def test_disk_checkpoints_equal_memory_ones_across_world_sizes(tmp_path: Path, kind: str) -> None:
    """Disk world 2 == memory world 2; disk world 2 -> memory world 3 and memory world 2 -> disk
    world 3 re-save the same checkpoint; bitwise, model and optimizer (masters included)."""
    s, ck = str(tmp_path), {n: tmp_path / n for n in ("mem2", "disk2", "mem3", "disk3")}
    run(2, checkpoint, kind, False, s, str(ck["mem2"]), timeout=SLOW)
    held = run(2, checkpoint, kind, True, s, str(ck["disk2"]), timeout=SLOW)
    run(3, checkpoint, kind, False, s, str(ck["mem3"]), str(ck["disk2"]), timeout=SLOW)
    run(3, checkpoint, kind, True, s, str(ck["disk3"]), str(ck["mem2"]), timeout=SLOW)
    assert held == [0, 0]  # the shards were on disk
    reference = _consolidated(ck["mem2"])
    trained = [k for k in reference if ".state." in k and k.endswith("exp_avg_sq")]
    assert trained and all(reference[k].abs().sum() > 0 for k in trained)  # the saved state is not blank
    for name in ("disk2", "mem3", "disk3"):
        assert _same(_consolidated(ck[name]), reference), name


# ------------------------------------------------------------------ memory of a save and a load
LAYERS, WIDTH = 24, 1024  # 25.2M fp32 parameters on disk: 48 MiB of shards per rank at world 2
DCP_OWN_BYTES = 16 << 20  # DCP's own buffers, plans and Python objects (as in test_dcp)


def disk_rss_growth(path: str) -> tuple[int, int, bool]:
    """Peak RSS growth of this rank during a DCP save and a load of a model on disk (after a
    warm-up save), and whether the load brought every saved shard back."""
    import torch.distributed as dist
    from parts.comm import dcp
    from parts.observe import set_mmap_threshold
    from parts.offload import DiskStore
    from parts.partition import load_sharded_state_dict, meta, partitioned, sharded_state_dict
    from parts.partition.core import disk
    set_mmap_threshold(1 << 20)  # freed buffers leave RSS at once: growth is what is held
    store = DiskStore(f"{path}-store-{dist.get_rank()}")
    with partitioned(remote_device=store):
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    dcp.save({"model": sharded_state_dict(model)}, checkpoint_id=path + "-warm")  # imports, pools
    saved = [disk.stored(meta(layer.weight).shard).read_whole() for layer in model]
    grown_save = peak_growth(lambda: dcp.save({"model": sharded_state_dict(model)}, checkpoint_id=path))
    for layer in model:  # the load must bring the values back
        with torch.no_grad(), disk.rewrite(meta(layer.weight).shard):
            meta(layer.weight).shard.zero_()

    def load() -> None:
        state = {"model": sharded_state_dict(model)}
        dcp.load(state, checkpoint_id=path)
        load_sharded_state_dict(model, state["model"])
    grown_load = peak_growth(load)
    back = all(torch.equal(disk.stored(meta(layer.weight).shard).read_whole(), values)
               for layer, values in zip(model, saved))
    store.close()
    return grown_save, grown_load, back


def test_disk_save_and_load_hold_one_shard_not_all(tmp_path: Path) -> None:
    """Bound: largest parameter (4 MiB) + 16 MiB for DCP; holding the rank's shards (48 MiB) fails it."""
    results = run(2, disk_rss_growth, str(tmp_path / "ckpt"), timeout=SLOW)
    largest = WIDTH * WIDTH * 4
    for rank, (save, load, back) in enumerate(results):
        assert back, f"rank {rank}: the load did not restore the saved shard"
        assert save <= largest + DCP_OWN_BYTES, f"rank {rank}: RSS grew {save / 2**20:.1f} MiB during a save"
        assert load <= largest + DCP_OWN_BYTES, f"rank {rank}: RSS grew {load / 2**20:.1f} MiB during a load"
    assert len(os.listdir(tmp_path / "ckpt")) > 2 * LAYERS  # one file per item (bounded DCP writer)


def test_a_store_lends_one_tensor_per_thread_and_writes_back_only_what_was_written(tmp_path: Path) -> None:
    from parts.offload import DiskStore
    from parts.offload.lease import Stored, lease_of
    with DiskStore(str(tmp_path)) as store:
        store.write("a", torch.arange(8.0)).wait()
        store.write("b", torch.arange(8.0, 20.0)).wait()
        a, b = Stored(store, "a", 8, torch.float32), Stored(store, "b", 12, torch.float32)
        assert torch.equal(a.narrow(0, 2, 3).materialize(), torch.tensor([2.0, 3.0, 4.0]))
        assert lease_of(store).held_bytes == 8 * 4
        written = store.stats.bytes_written
        b.narrow(0, 10, 2).materialize().copy_(torch.tensor([-1.0, -2.0]))  # a goes back, unwritten
        assert lease_of(store).held_bytes == 12 * 4 and store.stats.bytes_written == written
        assert b.materialize().data_ptr() == b.narrow(0, 10, 2).materialize().data_ptr() - 10 * 4
        b.settle()
        assert lease_of(store).held_bytes == 0 and store.stats.bytes_written == written + 12 * 4
        out = torch.empty(12)
        store.read("b", out).wait()
        assert out[10:].tolist() == [-1.0, -2.0] and out[:10].tolist() == list(range(8, 18))
