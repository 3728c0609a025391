"""``full_state_dict`` returns tensors the model does not share: editing them leaves the model as
it was, for persistent parameters (kept gathered by ``attach``), gathered ones and buffers."""

from __future__ import annotations

import pytest
import torch

from harness import run


def edit_the_dict() -> dict:
    from parts.partition import attach, full_state_dict, partitioned
    torch.manual_seed(0)
    with partitioned():
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 300))
    attach(model, persistence_threshold=1000)  # the small layers stay gathered, the 4800-element one not
    model(torch.randn(4, 8)).sum().backward()  # the persistent ones are gathered now
    before = {k: v.clone() for k, v in full_state_dict(model, rank0_only=False).items()}
    state = full_state_dict(model, rank0_only=False)
    live = {p.data.untyped_storage().data_ptr() for p in model.parameters()} | \
        {b.untyped_storage().data_ptr() for b in model.buffers()}
    shared = sorted(k for k, v in state.items() if v.untyped_storage().data_ptr() in live)
    with torch.no_grad():
        for v in state.values():
            v.add_(1)
    after = full_state_dict(model, rank0_only=False)
    return {"shared": shared, "unchanged": sorted(k for k in before if torch.equal(before[k], after[k])),
            "keys": sorted(before)}


@pytest.mark.parametrize("world", [2, 3])
def test_editing_the_full_state_dict_leaves_the_model_unchanged(world: int) -> None:
    for rank in run(world, edit_the_dict, timeout=120.0):
        assert rank["shared"] == [], rank
        assert rank["unchanged"] == rank["keys"], rank
