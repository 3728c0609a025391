"""Issue 21, parts.partition rows: writes through ``.data`` of a sharded parameter."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import RankFailure, run

FAST = 30.0  # seconds: a regression that hangs fails here instead of stalling the suite


def sharded_mlp() -> torch.nn.Module:
    """A seeded fp32 MLP sharded by partition_module."""
    from parts.partition import partition_module
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.GELU(), torch.nn.Linear(13, 5))
    partition_module(model)
    return model


def data_write(op: str) -> None:
    """Row 2: ``p.data.<op>`` on a released sharded parameter (after construction)."""
    model = sharded_mlp()
    data = model[2].weight.data
    assert data.shape == (0,) and data.numel() == 0  # metadata still answers
    getattr(data, op)()


@pytest.mark.parametrize("op", ["zero_", "normal_"])
def test_data_write_on_a_released_sharded_param_raises(op: str) -> None:
    """Row 2: the write would go nowhere, so it raises naming the param and the way to write it."""
    with pytest.raises(RankFailure, match=rf"parameter '2.weight' \(5, 13\).*`Tensor.{op}`.*"
                                          r"silently change nothing.*modifier_rank=0"):
        run(2, data_write, op, timeout=FAST)


def data_write_gathered() -> bool:
    """The way the error names: inside gathered(modifier_rank=0) the write reaches every shard."""
    from parts.partition import full_state_dict, gathered
    model = sharded_mlp()
    with gathered([model[2].weight], modifier_rank=0):
        model[2].weight.data.zero_()
    full = full_state_dict(model, rank0_only=False)
    return bool(torch.equal(full["2.weight"], torch.zeros(5, 13))) and bool(full["0.weight"].abs().sum() > 0)


def test_data_write_inside_gathered_with_modifier_rank_reaches_the_shards() -> None:
    """Row 2: the remedy works on every rank."""
    assert run(2, data_write_gathered, timeout=FAST) == [True, True]
