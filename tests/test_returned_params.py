"""An attached model whose modules return their own parameters, and torch.func transforms
through an attached model.

A module that returns a parameter as it is (Megatron's ``skip_bias_add`` layers return
``(output, bias)``, a positional table returns its weight) leaves it to the caller, which uses
it after the module's forward released it: the parameter becomes the caller's to fetch, with no
``register_external_parameter``. ``torch.func.grad``/``vjp`` w.r.t. the inputs equal the plain
model's; over the sharded parameters they are refused, naming the ways out.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from harness import run
from hidden_weight import Hidden
from torch import nn

from parts.checkpoint import checkpoint as parts_checkpoint
from parts.partition import (attach, full_state_dict, gathered, partition_module,
                             register_external_parameter, shards)

DIM = 6
PER_RANK = 2
STEPS = 3
LR = 0.1
KNOBS = dict(persistence_threshold=0)  # every parameter released between its uses (a large model's case)


class BiasOut(nn.Module):
    """A linear layer that returns ``(x @ W.T, bias)`` and leaves the add to its caller."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) * 0.4)
        self.bias = nn.Parameter(torch.randn(DIM) * 0.2)

    def forward(self, x):
        return F.linear(x, self.weight), self.bias


class Table(nn.Module):
    """A module whose forward returns its parameter alone (a learned positional table)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM) * 0.3)

    def forward(self):
        return self.weight


class Net(nn.Module):
    """The caller adds what ``BiasOut`` and ``Table`` return; ``wrap`` checkpoints ``BiasOut``."""

    def __init__(self, wrap: str) -> None:
        super().__init__()
        self.inp, self.proj, self.pos, self.head = nn.Linear(DIM, DIM), BiasOut(), Table(), nn.Linear(DIM, 1)
        self.wrap = wrap

    def forward(self, x):
        h = torch.tanh(self.inp(x)) + self.pos()
        if self.wrap == "torch":
            out, bias = torch.utils.checkpoint.checkpoint(self.proj, h, use_reentrant=False)
        elif self.wrap == "parts":
            out, bias = parts_checkpoint(self.proj, h)
        else:
            out, bias = self.proj(h)
        return self.head(torch.tanh(out + bias)).pow(2).mean()


def _rank_world() -> tuple[int, int]:
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def _batch(step: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + step))


def _pair(wrap: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = Net(wrap).double()
    return ref, partition_module(copy.deepcopy(ref))


def _train_returned(wrap: str, register: bool = False) -> tuple:
    rank, world = _rank_world()
    ref, model = _pair(wrap)
    co = attach(model, **KNOBS)
    if register:
        register_external_parameter(model, model.proj.bias)
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=LR), torch.optim.SGD(shards(model), lr=LR)
    fetches = []
    for step in range(STEPS):
        x = _batch(step, PER_RANK * world)
        ref(x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(x[rank * PER_RANK:(rank + 1) * PER_RANK]).backward()
        opt.step()
        opt.zero_grad()
        fetches.append(co.stats().fetches)
    got = full_state_dict(model, rank0_only=False)
    return {k: v.clone() for k, v in ref.state_dict().items()}, got, fetches


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("wrap", ["none", "torch", "parts"])
def test_returned_parameters_train_like_one_process_without_registration(world, wrap):
    for want, got, fetches in run(world, _train_returned, wrap, timeout=120):
        assert want.keys() == got.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-9, atol=1e-12, msg=key)
        assert fetches[1] == fetches[2]  # each step fetches the same: nothing piles up on the parameters


def test_registering_a_returned_parameter_still_trains_like_one_process():
    for want, got, _ in run(2, _train_returned, "none", True, timeout=120):
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-9, atol=1e-12, msg=key)


def _hidden_use() -> str:
    torch.manual_seed(0)
    first = nn.Linear(DIM, DIM)
    model = partition_module(nn.Sequential(first, Hidden(first)).double())
    model[1].__dict__["refs"] = [model[0].weight]
    attach(model, **KNOBS)
    try:
        model(_batch(0, PER_RANK)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_released_parameter_used_by_another_module_names_register_external_parameter():
    for message in run(2, _hidden_use, timeout=60):
        assert "parameter '0.weight' (6, 6) of module '0' (Linear) is released" in message
        assert "parts.partition.register_external_parameter(module, param)" in message


# ------------------------------------------------------------------------ torch.func
def _func_net() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1)).double()
    return ref, partition_module(copy.deepcopy(ref))


def _func_inputs(knobs: dict) -> tuple:
    ref, model = _func_net()
    attach(model, **knobs)
    x = _batch(0, PER_RANK)
    out = []
    for net in (ref, model):
        grad = torch.func.grad(lambda v: net(v).pow(2).sum())(x)
        y, pull = torch.func.vjp(net, x)
        per_row = torch.func.vmap(torch.func.grad(lambda v: net(v).pow(2).sum()))(x)
        out.append((grad, pull(torch.ones_like(y))[0], y, torch.func.jacrev(net)(x), per_row))
    return out


@pytest.mark.parametrize("knobs", [{}, KNOBS], ids=["default", "released"])
def test_torch_func_transforms_over_inputs_of_an_attached_model_equal_the_plain_model(knobs):
    for want, got in run(2, _func_inputs, knobs, timeout=60):
        for a, b in zip(want, got):
            assert torch.equal(a, b)


def _func_params(how: str) -> tuple:
    ref, model = _func_net()
    attach(model, **KNOBS)
    x = _batch(0, PER_RANK)

    def grads(net: nn.Module, params: dict) -> dict:
        return torch.func.grad(lambda p: torch.func.functional_call(net, p, (x,)).pow(2).sum())(params)

    want = grads(ref, dict(ref.named_parameters()))
    if how == "sharded":
        try:
            grads(model, dict(model.named_parameters()))
        except RuntimeError as e:
            return str(e)
        return "no error"
    if how == "full_state_dict":
        got = grads(model, full_state_dict(model, rank0_only=False))
    else:
        with gathered(list(model.parameters())):
            got = grads(model, dict(model.named_parameters()))
    return {k: torch.equal(want[k], got[k]) for k in want}


def test_torch_func_over_sharded_parameters_is_refused_naming_the_ways_out():
    for message in run(2, _func_params, "sharded", timeout=60):
        assert message.startswith("parts.partition: a torch.func transform is taken over parameter "
                                  "'0.weight' (6, 6)")
        assert "full_state_dict(model, rank0_only=False)" in message
        assert "torch.func.functional_call(model, sd, args)" in message
        assert "with parts.partition.gathered(list(model.parameters())):" in message


@pytest.mark.parametrize("how", ["full_state_dict", "gathered"])
def test_the_ways_out_give_the_plain_models_parameter_grads(how):
    for equal in run(2, _func_params, how, timeout=60):
        assert equal and all(equal.values()), equal
