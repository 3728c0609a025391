"""Owner-held optimizer state in sharded DCP checkpoints: saved at world 2, resumed at world 3 and 2,
the later losses equal to an uninterrupted run's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import run
from test_whole_optim import Shapes, _optimizers

STEPS, SAVE_AFTER = 6, 3


def train(path: str, kind: str, resume: bool) -> list[float]:
    """Steps SAVE_AFTER..STEPS after loading ``path`` (resume), else 0..STEPS saving after SAVE_AFTER;
    the global loss of each step (the same global batch at any world size)."""
    import torch.distributed.checkpoint as dcp
    from parts.comm import dcp as parts_dcp
    from parts.partition import (attach, load_sharded_optimizer_state_dict, load_sharded_state_dict,
                                 partition_module, shards, sharded_optimizer_state_dict, sharded_state_dict)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = partition_module(Shapes().double())
    attach(model)
    leaves = shards(model)
    opts = _optimizers(kind, [t for t in leaves if t.ndim == 2], [t for t in leaves if t.ndim != 2], leaves)
    start = 0
    if resume:
        state = {"model": sharded_state_dict(model), "step": 0,
                 **{f"optim{i}": sharded_optimizer_state_dict(model, o) for i, o in enumerate(opts)}}
        dcp.load(state, checkpoint_id=path)
        load_sharded_state_dict(model, state["model"])
        for i, o in enumerate(opts):
            load_sharded_optimizer_state_dict(model, o, state[f"optim{i}"])
        start = state["step"]
        held = sum(sum(1 for entry in o.state.values() if entry) for o in opts)  # state installed here
    losses = []
    for step in range(start, STEPS):
        x = torch.randn(12, 5, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        loss = model(x.chunk(world)[rank])
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if not resume and step + 1 == SAVE_AFTER:
            state = {"model": sharded_state_dict(model), "step": SAVE_AFTER,
                     **{f"optim{i}": sharded_optimizer_state_dict(model, o) for i, o in enumerate(opts)}}
            parts_dcp.save(state, checkpoint_id=path)
    return losses + ([held] if resume else [])


@pytest.mark.parametrize("kind,after", [("adafactor", 3), ("adafactor", 2), ("muon", 3)])
def test_whole_tensor_state_resumes_at_another_world_size(tmp_path: Path, kind: str, after: int) -> None:
    whole = run(2, train, str(tmp_path), kind, False, timeout=120)[0]
    ranks = run(after, train, str(tmp_path), kind, True, timeout=120)
    # whole-tensor state loaded once, on each owner; AdamW's (the bias, beside Muon) on every rank's shard
    assert sum(r.pop() for r in ranks) == (5 if kind == "adafactor" else 4 + after)
    resumed = ranks[0]
    assert len(resumed) == STEPS - SAVE_AFTER and whole[SAVE_AFTER] != whole[0]
    for ours, reference in zip(resumed, whole[SAVE_AFTER:]):
        assert abs(ours - reference) <= 1e-9 * abs(reference), (resumed, whole)
