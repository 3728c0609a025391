"""Sharded checkpoints through torch.distributed.checkpoint (DCP): FSDP2 interchange, resume at
another world size (model + Adam, BF16Optimizer), dcp_to_torch_save, memory of a save."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import run
from parts.base.boxes import flat_boxes

SLOW = 240.0  # DCP's first import in a worker takes seconds on a loaded 2-core machine


# ------------------------------------------------------------------ pure box arithmetic
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=0, max_size=4), st.data())
def test_flat_boxes_tile_the_range_in_flat_order(shape, data) -> None:
    numel = 1
    for d in shape:
        numel *= d
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    boxes = flat_boxes(shape, start, stop)
    index = torch.arange(numel).view(shape) if shape else torch.tensor(0)
    covered = []
    for box in boxes:
        region = index[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
        flat = region.reshape(-1).tolist()
        assert flat == list(range(box.flat_start, box.flat_start + box.numel))  # contiguous: a view
        covered += flat
    assert covered == list(range(start, stop))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_flat_boxes_of_a_2d_shard_are_three_row_aligned_rectangles() -> None:
    boxes = flat_boxes((4, 5), 3, 17)
    assert [(b.offsets, b.sizes) for b in boxes] == [((0, 3), (1, 2)), ((1, 0), (2, 5)), ((3, 0), (1, 2))]
    with pytest.raises(ValueError, match="outside a tensor of shape"):
        flat_boxes((4, 5), 3, 21)


def test_shard_view_is_not_data() -> None:
    from parts.comm.dcp import ShardView
    flat = torch.arange(6.0)
    view = ShardView((3, 4), [(3, flat)], name="w")
    assert view.shape == (3, 4) and [o for o, _ in view.pieces()] == [(0, 3), (1, 0), (2, 0)]
    assert view.pieces()[1][1].data_ptr() == flat.data_ptr() + 1 * 4  # a view of the segment
    with pytest.raises(RuntimeError, match="ShardView of .w.*not data"):
        view + 1


# ------------------------------------------------------------------ FSDP2 <-> parts
def _small_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3),
                               torch.nn.Conv1d(3, 2, 3))


def fsdp2_side(path: str, mode: str) -> dict:
    """FSDP2 (fully_shard per layer) saves or loads ``{"model": get_model_state_dict(m)}``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(1 if mode == "save" else 2)
    model = _small_model()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if mode == "save":
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    else:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.clone() for k, v in full.items()}


def parts_side(path: str, mode: str) -> dict:
    """parts (partitioned) saves or loads ``{"model": sharded_state_dict(m)}`` with dcp itself."""
    import torch.distributed.checkpoint as dcp
    from parts.partition import full_state_dict, load_sharded_state_dict, partitioned, sharded_state_dict
    torch.manual_seed(3 if mode == "save" else 4)
    with partitioned():
        model = _small_model()
    state = {"model": sharded_state_dict(model)}
    if mode == "save":
        dcp.save(state, checkpoint_id=path)
    else:
        dcp.load(state, checkpoint_id=path)
        load_sharded_state_dict(model, state["model"])
    return full_state_dict(model, rank0_only=False)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fsdp2_world_2_checkpoint_loads_into_parts_world_3_bitwise(tmp_path: Path) -> None:
    saved = run(2, fsdp2_side, str(tmp_path), "save", timeout=SLOW)[0]
    loaded = run(3, parts_side, str(tmp_path), "load", timeout=SLOW)
    assert all(_equal(saved, full) for full in loaded)


def test_parts_world_3_checkpoint_loads_into_fsdp2_world_2_bitwise(tmp_path: Path) -> None:
    saved = run(3, parts_side, str(tmp_path), "save", timeout=SLOW)[0]
    loaded = run(2, fsdp2_side, str(tmp_path), "load", timeout=SLOW)
    assert all(_equal(saved, full) for full in loaded)


# ------------------------------------------------------------------ resume at another world size
STEPS, SAVE_AFTER, ROWS = 5, 3, 12  # 12 rows: every world size 1..4 splits the global batch evenly
RESUME_RTOL = 1e-5  # sums over ranks change order with the world size; observed ~1e-7


def _build(kind: str, scratch: str = ""):
    """A small model (sharded or half sharded) and its optimizer (state on disk for "offload")."""
    import torch.distributed as dist
    from parts.offload import DiskStore, OffloadedOptimizer
    from parts.optim import BF16Optimizer
    from parts.partition import partition_module, partitioned, shards
    torch.manual_seed(0)
    if kind in ("adam", "offload"):
        with partitioned():
            model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.LayerNorm(9), torch.nn.Tanh(),
                                        torch.nn.Linear(9, 4))
        adam = torch.optim.Adam(shards(model), lr=1e-2)
        if kind == "adam":
            return model, adam
        store = DiskStore(f"{scratch}-store-{dist.get_world_size()}-{dist.get_rank()}")
        return model, OffloadedOptimizer(adam, store, chunk_bytes=256)
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.LayerNorm(9), torch.nn.Tanh(),
                                torch.nn.Linear(9, 4))
    partition_module(model[0])
    partition_module(model[3])  # the LayerNorm stays replicated: BF16Optimizer's flat group
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, BF16Optimizer(inner, allow_fp32=True, named_parameters=model.named_parameters())


def train(path: str, kind: str, resume: bool) -> list[float]:
    """Steps SAVE_AFTER..STEPS after loading ``path`` (resume), else 0..STEPS saving after SAVE_AFTER;
    the global loss of every step, the same global batch at any world size."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from parts.comm import dcp as parts_dcp
    from parts.partition import (gathered, is_partitioned, load_sharded_optimizer_state_dict,
                                 load_sharded_state_dict, reduce_scatter_grads, sharded_optimizer_state_dict,
                                 sharded_state_dict)
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = _build(kind, path)
    generator = torch.Generator().manual_seed(5)
    data = [(torch.randn(ROWS, 6, generator=generator), torch.randn(ROWS, 4, generator=generator))
            for _ in range(STEPS)]
    start = 0
    if resume:
        state = {"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, opt), "step": 0}
        dcp.load(state, checkpoint_id=path)
        load_sharded_state_dict(model, state["model"])
        load_sharded_optimizer_state_dict(model, opt, state["optim"])
        start = state["step"]
    sharded = [p for p in model.parameters() if is_partitioned(p)]
    losses = []
    for step in range(start, STEPS):
        x, y = (t.chunk(world)[rank] for t in data[step])
        with gathered(sharded):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            reduce_scatter_grads(sharded)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if not resume and step + 1 == SAVE_AFTER:
            state = {"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, opt),
                     "step": SAVE_AFTER}
            parts_dcp.save(state, checkpoint_id=path)
    return losses


@pytest.mark.parametrize("kind,before,after", [("adam", 2, 3), ("adam", 4, 1), ("bf16", 2, 3),
                                                      ("bf16", 4, 1), ("offload", 2, 3)])
def test_resume_at_another_world_size_continues_the_run(tmp_path: Path, kind: str, before: int, after: int) -> None:
    """The steps after a resume at another world size have the uninterrupted run's losses."""
    whole = run(before, train, str(tmp_path), kind, False, timeout=SLOW)[0]
    resumed = run(after, train, str(tmp_path), kind, True, timeout=SLOW)[0]
    assert len(resumed) == STEPS - SAVE_AFTER
    for ours, reference in zip(resumed, whole[SAVE_AFTER:]):
        assert abs(ours - reference) <= RESUME_RTOL * abs(reference), (resumed, whole)
    assert whole[SAVE_AFTER] != whole[0]  # it trained: the resumed losses are not the start's


def fresh_optimizer_next_loss(path: str) -> float:
    """The loss after one step from the checkpoint's weights with a *fresh* Adam (no loaded state)."""
    import torch.distributed.checkpoint as dcp
    from parts.partition import load_sharded_state_dict, sharded_state_dict
    model, opt = _build("adam")
    state = {"model": sharded_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    load_sharded_state_dict(model, state["model"])
    return _one_step_loss(model, opt)


def _one_step_loss(model, opt) -> float:
    import torch.distributed as dist
    from parts.partition import gathered, reduce_scatter_grads
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(5)
    data = [(torch.randn(ROWS, 6, generator=generator), torch.randn(ROWS, 4, generator=generator))
            for _ in range(STEPS)]
    losses = []
    for step in (SAVE_AFTER, SAVE_AFTER + 1):
        x, y = (t.chunk(world)[rank] for t in data[step])
        with gathered(list(model.parameters())):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            reduce_scatter_grads(list(model.parameters()))
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses[1]


def test_the_loaded_adam_state_matters(tmp_path: Path) -> None:
    """Control for the resume test: with the weights alone (fresh Adam) the second step differs."""
    whole = run(2, train, str(tmp_path), "adam", False, timeout=SLOW)[0]
    fresh = run(3, fresh_optimizer_next_loss, str(tmp_path), timeout=SLOW)[0]
    assert abs(fresh - whole[SAVE_AFTER + 1]) > 100 * RESUME_RTOL * abs(whole[SAVE_AFTER + 1])


# ------------------------------------------------------------------ one torch.save file
def save_parts_checkpoint(path: str) -> dict:
    from parts.comm import dcp as parts_dcp
    from parts.partition import full_state_dict, partitioned, sharded_state_dict
    torch.manual_seed(6)
    with partitioned():
        model = _small_model()
    parts_dcp.save({"model": sharded_state_dict(model)}, checkpoint_id=path)
    return full_state_dict(model)


def test_dcp_to_torch_save_loads_into_a_plain_model_strictly(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    full = run(3, save_parts_checkpoint, str(tmp_path / "ckpt"), timeout=SLOW)[0]
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "model.pt")
    plain = _small_model()
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True)["model"], strict=True)
    assert _equal(plain.state_dict(), full)


# ------------------------------------------------------------------ memory of a save
LAYERS, WIDTH = 12, 1024  # 12.6M fp32 parameters: 48 MiB, 24 MiB per rank at world 2
DCP_OWN_BYTES = 16 << 20  # bound on DCP's own buffers, plans and Python objects during a save


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_growth(fn) -> int:
    """Peak RSS growth (sampled every ms) of this process while ``fn()`` runs."""
    base, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], _rss()) - base


def save_rss_growth(path: str) -> int:
    """Peak RSS growth of this rank during the second of two saves."""
    from parts.comm import dcp as parts_dcp
    from parts.partition import partitioned, sharded_state_dict
    with partitioned():
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    parts_dcp.save({"model": sharded_state_dict(model)}, checkpoint_id=path + "-warm")  # imports, pools
    return peak_growth(lambda: parts_dcp.save({"model": sharded_state_dict(model)}, checkpoint_id=path))


def test_save_holds_no_more_than_the_largest_parameter_plus_dcp_buffers(tmp_path: Path) -> None:
    """Bound: largest parameter (4 MiB) + 16 MiB for DCP; a save that copied the shard (24 MiB) fails it."""
    growth = run(2, save_rss_growth, str(tmp_path / "ckpt"), timeout=SLOW)
    largest = WIDTH * WIDTH * 4
    for rank, grown in enumerate(growth):
        assert grown <= largest + DCP_OWN_BYTES, f"rank {rank}: RSS grew {grown / 2**20:.1f} MiB during a save"
