"""parts.partition: writes through ``.data`` of a sharded parameter."""

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
    """``p.data.<op>`` on a released sharded parameter (after construction)."""
    model = sharded_mlp()
    data = model[2].weight.data
    assert data.shape == (0,) and data.numel() == 0  # metadata still answers
    getattr(data, op)()


@pytest.mark.parametrize("op", ["zero_", "normal_"])
def test_data_write_on_a_released_sharded_param_raises(op: str) -> None:
    """The write would go nowhere, so it raises naming the param and the way to write it."""
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
    """The remedy works on every rank."""
    assert run(2, data_write_gathered, timeout=FAST) == [True, True]


def uneven_steps(case: str) -> str:
    """Debug mode; rank 1 runs one batch fewer, then every rank saves (or steps)."""
    from datetime import timedelta

    from parts.optim import BF16Optimizer
    from parts.partition import RankDivergence, attach, full_state_dict, partition_module
    group = dist.new_group([0, 1], timeout=timedelta(seconds=10))  # a regression fails fast
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.GELU(), torch.nn.Linear(13, 5))
    partition_module(model.to(torch.bfloat16), group=group)
    attach(model, group=group, debug=True, persistence_threshold=0)
    opt = BF16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), group=group)
    rank = dist.get_rank()
    try:
        for step in range(3 - (rank == 1)):  # rank 1 has one batch fewer
            if case == "skip" and rank == 1 and step == 1:
                opt.step()  # skipped its forward and backward, went on to the optimizer step
                continue
            model(torch.ones(2, 7, dtype=torch.bfloat16)).float().sum().backward()
            opt.step()
            opt.zero_grad()
        full_state_dict(model)  # rank 1 saves while rank 0 still trains
    except RankDivergence as exc:
        return str(exc)
    return "no divergence found"


@pytest.mark.parametrize("case", ["uneven", "skip"])
def test_debug_mode_names_ranks_and_steps_of_an_uneven_batch_count(case: str) -> None:
    """RankDivergence on both ranks naming what each does and how many steps it began."""
    out = run(2, uneven_steps, case, timeout=FAST)
    assert out[0] == out[1], out
    msg = out[0]
    assert "ranks are at different steps" in msg, msg
    if case == "uneven":
        assert "rank 0 is at the start of its step" in msg and "train step 2" in msg, msg
        assert "rank 1 is at `full_state_dict` outside any step, after 2 steps begun" in msg, msg
    else:
        assert "rank 1 is at `BF16Optimizer.step` outside any step, after 1 steps begun" in msg, msg
        assert "rank 0 is at the start of its step" in msg and "train step 1" in msg, msg
