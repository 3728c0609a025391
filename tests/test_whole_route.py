"""Which path an optimizer over shards takes: listed element-wise ones and custom element-wise ones
the shards, shape-aware ones (torch's and custom) whole tensors, and a user's override."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from harness import run
from test_whole_optim import RTOL, Lamb, Shapes, SignSGD, train_body

from parts.partition import partition_module, shards
from parts.partition.whole import ELEMENT_WISE, needs_whole
from parts.partition.whole.paths import choose


def test_element_wise_list_and_probe_agree_on_torch_optimizers() -> None:
    for cls in ELEMENT_WISE - {torch.optim.SparseAdam}:
        assert not needs_whole(cls([torch.zeros(2, 2)])), cls.__name__
    for cls in (torch.optim.Adafactor, torch.optim.Muon, Lamb):
        assert needs_whole(cls([torch.zeros(2, 2)])), cls.__name__
    assert not needs_whole(SignSGD([torch.zeros(2, 2)]))


def test_the_probe_logs_one_line_naming_the_optimizer_and_path(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="parts.partition"):
        assert choose(torch.optim.Adafactor([torch.zeros(2, 2)]), None) == "whole"
        assert choose(torch.optim.AdamW([torch.zeros(2, 2)]), None) == "shard"  # listed: no probe, no line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "Adafactor takes the whole-tensor path" in lines[0]


def test_custom_element_wise_optimizer_keeps_the_shard_path_exactly() -> None:
    for result in run(2, train_body, "sign", timeout=120):
        assert result["paths"] == ["shard"]
        assert max(result["errors"].values()) < RTOL, result["errors"]


def test_override_whole_for_adamw_is_exact_and_shard_for_adafactor_is_the_flat_result() -> None:
    for result in run(3, train_body, "adamw", 1, "whole", timeout=120):
        assert result["paths"] == ["whole"] and max(result["errors"].values()) < RTOL
    for result in run(3, train_body, "adafactor", 1, "shard", timeout=120):
        assert result["paths"] == ["shard"] and max(result["errors"].values()) > 1e-3  # another algorithm


def _grouping_body():
    torch.manual_seed(0)
    model = partition_module(Shapes().double())
    leaves = shards(model)
    two = [tuple(t.shape) for t in leaves if t.ndim == 2]
    return two, [t.dim() for t in leaves], dist.get_world_size()


def test_shard_leaves_answer_with_the_full_shape_for_grouping() -> None:
    for two, dims, _ in run(3, _grouping_body):
        assert two == [(1, 7), (6, 1), (3, 6), (7, 5)] and dims == [2, 2, 2, 2, 1]
