"""Sharded parameters answer shape queries as the full tensor, so grouping idioms select the same
parameters as on the unsharded model; storage stays 1/N and a released parameter in math raises."""

import copy

import pytest
import torch
from torch import nn

from harness import run
from parts.partition import meta, partition_module, partitioned, shards, use_shards
from parts.partition.coordinator import attach
from test_coordinator_models import full_params, rank_info

ROWS = 4  # per rank


class Uneven(nn.Module):
    """7x5, 1xN, Nx1 and 2xN (fewer rows than ranks at world 3) weights, biases, a scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.row = nn.Parameter(torch.randn(1, 7))
        self.col = nn.Parameter(torch.randn(7, 1))
        self.few = nn.Linear(7, 2, bias=False)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * self.row
        return ((self.few(h).sum(-1, keepdim=True) + h @ self.col) * self.scale).square().mean()


def _queries(p: torch.Tensor) -> tuple:
    return (p.shape, p.size(), [p.size(d) for d in range(-p.dim(), p.dim())], p.ndim, p.dim(),
            p.ndimension(), p.numel(), p.nelement(), torch.numel(p), p.stride(), p.nbytes,
            len(p) if p.dim() else None)


def _configure_optimizers(model: nn.Module, weight_decay: float) -> torch.optim.Optimizer:
    """nanoGPT's grouping: weight decay on every parameter with at least 2 dimensions."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)


def _names(model: nn.Module, keep) -> list[str]:
    return [n for n, p in model.named_parameters() if keep(p)]


def _shape_case() -> dict:
    rank, world = rank_info()
    torch.manual_seed(0)
    ref = Uneven()
    with partitioned():
        torch.manual_seed(0)
        built = Uneven()
    model = partition_module(copy.deepcopy(ref))
    out = {"ref": [_queries(p) for p in ref.parameters()],
           "built": [_queries(p) for p in built.parameters()],
           "released": [_queries(p) for p in model.parameters()],
           "storage": [(p.untyped_storage().nbytes(), meta(p).shard.numel(), meta(p).layout.shard_numel)
                       for p in model.parameters()],
           "groups": [(_names(m, lambda p: p.ndim >= 2), _names(m, lambda p: p.dim() == 2))
                      for m in (ref, model)]}
    try:
        model.a.weight @ torch.ones(5)
        out["math"] = "no error"
    except RuntimeError as err:
        out["math"] = str(err)
    attach(model, persistence_threshold=0)  # every parameter is released between uses
    opt_ref = _configure_optimizers(ref, 0.5)
    opt = use_shards(_configure_optimizers(model, 0.5))
    for step in range(3):
        x = torch.randn(ROWS * world, 5, generator=torch.Generator().manual_seed(step))
        ref(x).backward()
        model(x[rank * ROWS:(rank + 1) * ROWS]).backward()
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    out["attached"] = [_queries(p) for p in model.parameters()]  # after training: some released
    out["status"] = {meta(p).status.value for p in model.parameters()}
    out["trained"] = ([p.detach() for p in ref.parameters()], full_params(model))
    out["group_sizes"] = [len(g["params"]) for g in opt.param_groups]
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shape_queries_are_the_full_tensors_and_groupings_agree(world):
    for out in run(world, _shape_case):
        assert out["built"] == out["ref"] and out["released"] == out["ref"] and out["attached"] == out["ref"]
        assert out["groups"][0] == out["groups"][1] == (["row", "col", "a.weight", "few.weight"],) * 2
        assert out["group_sizes"] == [4, 2] and out["status"] == {"not_available"}
        for nbytes, shard, per_rank in out["storage"]:  # a released parameter holds no storage
            assert nbytes == 0 and shard == per_rank
        assert "parameter 'a.weight' (7, 5)" in out["math"] and "released" in out["math"]
        # weight decay went where it goes unsharded: the same weights (fp32, ranks sum in another order)
        for a, b in zip(*out["trained"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_shard_numel_is_a_fraction_of_the_full_numel():
    # storage stays 1/N: each rank's shard of the 7x5 weight at world 3 holds 12 of its 35 elements
    sizes = run(3, _shard_sizes)
    assert sizes == [(35, 12)] * 3


def _shard_sizes() -> tuple:
    with partitioned():
        layer = nn.Linear(5, 7)
    return layer.weight.numel(), meta(layer.weight).shard.numel()


def test_size_out_of_range_raises_like_torch():
    with partitioned():
        layer = nn.Linear(5, 7)
    with pytest.raises(IndexError, match="Dimension out of range"):
        layer.weight.size(2)
    with pytest.raises(IndexError, match="Dimension out of range"):
        layer.bias.stride(-2)
    leaf, flat = shards(layer)[0], meta(layer.weight).layout.shard_numel
    assert meta(layer.weight).shard.shape == (flat,)  # shards stay flat
    assert leaf.shape == (7, 5) and leaf.shard_numel == flat  # the optimizer's leaf answers with the full shape


def _requires_grad_case() -> dict:
    rank, world = rank_info()
    torch.manual_seed(0)
    ref = Uneven()
    model = partition_module(copy.deepcopy(ref))
    for m in (ref, model):
        m.few.requires_grad_(False)  # a frozen layer
        m.scale.requires_grad = False
    out = {"filtered": [s.requires_grad for s in shards(model)]}
    model.scale.requires_grad_(True)
    out["follows"] = meta(model.scale).shard.requires_grad
    model.scale.requires_grad = False
    out["follows"] = (out["follows"], meta(model.scale).shard.requires_grad)
    attach(model, persistence_threshold=0)
    opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    opt = torch.optim.SGD([s for s in shards(model) if s.requires_grad], lr=0.1)
    for step in range(2):
        x = torch.randn(ROWS * world, 5, generator=torch.Generator().manual_seed(step))
        ref(x).backward()
        model(x[rank * ROWS:(rank + 1) * ROWS]).backward()
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    out["trained"] = ([p.detach() for p in ref.parameters()], full_params(model))
    try:  # a trainable shard is written like a trainable parameter: under torch.no_grad()
        meta(model.a.weight).shard.add_(1.0)
        out["write"] = "no error"
    except RuntimeError as err:
        out["write"] = str(err)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_shards_of_trainable_params_require_grad(world):
    for out in run(world, _requires_grad_case):
        # row, col, a.weight, a.bias train; scale and few.weight are frozen (own params come first)
        assert out["filtered"] == [True, True, False, True, True, False]
        assert out["follows"] == (True, False)
        assert "requires grad" in out["write"]
        for a, b in zip(*out["trained"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
