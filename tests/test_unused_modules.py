"""Ranks that run different modules in one step train as one process running the whole batch.

Per-rank heads (``heads[rank](x)``), a tiny MoE whose experts run only for the tokens routed to
them (some expert gets none on some rank), and a branch one rank takes: sharded at world 2 and 3
against one process on the global batch, in float64, 3 SGD steps, every parameter compared.
Modules gathered with others need nothing declared; modules gathered by collectives of their own
are declared ``conditional`` or refused, naming the modules and ranks.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run
from parts.partition import RankDivergence, attach, full_state_dict, partition_module, shards
from parts.partition.coordinator import attached_to

D, ROWS, STEPS, LR = 6, 3, 3, 0.5
PER_MODULE = {"persistence_threshold": 0, "fetch_unit_size": 0}  # every module gathers its own


class Heads(nn.Module):
    """A trunk and one head per rank; rank ``r`` runs ``heads[r]`` only."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.trunk = nn.Linear(D, D)
        self.heads = nn.ModuleList(nn.Linear(D, 2) for _ in range(world))

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        return self.heads[rank](torch.tanh(self.trunk(x))).square().mean()


class Expert(nn.Module):
    """One feed-forward expert."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 8), nn.Linear(8, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class MoE(nn.Module):
    """Top-1 routing; an expert runs only on the tokens routed to it (DeepSeek-style, older Mixtral)."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(D, experts, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        weight, route = self.router(x).softmax(-1).max(-1)
        out, ran = torch.zeros_like(x), []
        for e in range(len(self.experts)):
            idx = (route == e).nonzero().squeeze(-1)
            if idx.numel():
                out[idx] += weight[idx, None] * self.experts[e](x[idx])
                ran.append(e)
        return x + out, ran


class MoENet(nn.Module):
    """An embedding-like input layer, one MoE block, an output layer."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.inp, self.moe, self.out = nn.Linear(D, D), MoE(), nn.Linear(D, 1)
        self.ran: list[int] = []

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h, self.ran = self.moe(torch.tanh(self.inp(x)))
        return self.out(h).square().mean()


class Branch(nn.Module):
    """A residual branch that rank 0 alone takes."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.trunk, self.extra, self.out = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if rank == 0:
            h = h + self.extra(h)
        return self.out(h).square().mean()


MODELS = {"heads": Heads, "moe": MoENet, "branch": Branch}
CONDITIONAL = {"heads": lambda m: [m.heads], "moe": lambda m: [Expert], "branch": lambda m: [m.extra]}


def _batch(step: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(world, ROWS, D, generator=g, dtype=torch.float64)


def _reference_loss(ref: nn.Module, name: str, xs: torch.Tensor) -> torch.Tensor:
    """One process, the whole global batch: the mean of the ranks' losses (MoE: over all tokens at once)."""
    world = xs.shape[0]
    if name == "moe":
        return ref(xs.reshape(-1, D), 0)
    return sum(ref(xs[r], r) for r in range(world)) / world


def _train(name: str, knobs: dict, conditional: bool) -> tuple:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = MODELS[name](world).double()
    model = partition_module(copy.deepcopy(ref))
    attach(model, **knobs, **({"conditional": CONDITIONAL[name](model)} if conditional else {}))
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=LR), torch.optim.SGD(shards(model), lr=LR)
    ran, zeros = [], 0
    for step in range(STEPS):
        xs = _batch(step, world)
        _reference_loss(ref, name, xs).backward()
        model(xs[rank], rank).backward()
        ran.append(getattr(model, "ran", None))
        zeros += attached_to(model).uneven.zero_filled
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    got = full_state_dict(model, rank0_only=False)
    return ({k: v.detach() for k, v in ref.state_dict().items()}, got, ran, zeros) if rank == 0 else (None, None,
                                                                                                      ran, zeros)


def _assert_equal_to_one_process(out: list) -> None:
    want, got, _, _ = out[0]
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v) or (got[k] - v).abs().max() <= 1e-9 * v.abs().max(), k


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["heads", "moe", "branch"])
def test_ranks_running_different_modules_train_as_one_process_at_default_knobs(name, world):
    out = run(world, _train, name, {}, False)
    _assert_equal_to_one_process(out)
    assert sum(o[3] for o in out) > 0  # some rank lacked a grad another had, and reduced zeros


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["heads", "moe", "branch"])
def test_conditional_modules_gathered_one_by_one_train_as_one_process(name, world):
    # every module its own fetch unit, tiny grad buckets: only `conditional` keeps the collectives paired
    out = run(world, _train, name, {**PER_MODULE, "reduce_bucket_size": 16}, True)
    _assert_equal_to_one_process(out)


def test_some_expert_gets_no_tokens_on_some_rank_while_another_rank_runs_it():
    out = run(3, _train, "moe", {}, False)
    runs = [[set(o[2][step]) for o in out] for step in range(STEPS)]
    assert any(len({frozenset(r) for r in step}) > 1 for step in runs)  # the ranks ran other experts
    assert all(len(r) < 4 for step in runs for r in step)  # with 3 tokens, some expert idles on each rank
    _assert_equal_to_one_process(out)


def test_an_moe_block_gathered_as_one_unit_needs_nothing_declared():
    # the block is one fetch unit, its experts inside it: gathers pair whatever the routing
    _assert_equal_to_one_process(run(2, _train, "moe", {"persistence_threshold": 0}, False))


def _undeclared(no_grad: bool) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = partition_module(Heads(world).double())
    attach(model, **PER_MODULE)
    try:
        with torch.set_grad_enabled(not no_grad):
            loss = model(_batch(0, world)[rank], rank)
        if not no_grad:
            loss.backward()
    except RankDivergence as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("no_grad", [False, True])
def test_heads_gathered_one_by_one_without_declaring_them_raise_on_every_rank_naming_them(no_grad):
    messages = run(3, _undeclared, no_grad)
    assert len(set(messages)) == 1
    for r in range(3):
        assert f"'heads.{r}'] on rank(s) [{r}]" in messages[0]
    assert "conditional=" in messages[0]


BAD = {"foreign": lambda m: [nn.Linear(2, 2)], "root": lambda m: [m], "name": lambda m: ["heads"]}


def _bad_knob(kind: str) -> str:
    model = partition_module(Heads(2))
    try:
        attach(model, conditional=BAD[kind](model))
    except (TypeError, ValueError) as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("kind, words", [("foreign", "not a submodule"), ("root", "whole step"),
                                         ("name", "modules or module classes")])
def test_a_bad_conditional_is_refused_naming_it(kind, words):
    messages = run(2, _bad_knob, kind)
    assert all(words in m for m in messages), messages


def _train_hybrid(name: str, sync: str) -> float:
    """A 2 x 2 hybrid layout (``sync``: the default, "step", or "no_sync" accumulation of two
    micro-batches); the largest relative difference from one process, on rank 0."""
    import contextlib
    from torch.distributed.device_mesh import init_device_mesh
    from parts.partition import load_full_state_dict, no_sync, partitioned, set_replica_sync
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = MODELS[name](world).double()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    with partitioned(mesh=mesh, dtype=torch.float64):
        model = MODELS[name](world)
    load_full_state_dict(model, ref.state_dict())
    attach(model)
    if sync == "step":
        set_replica_sync(model, "step")
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=LR), torch.optim.SGD(shards(model), lr=LR)
    micro = 2 if sync == "no_sync" else 1
    for step in range(STEPS):
        for j in range(micro):
            xs = _batch(micro * step + j, world)
            _reference_loss(ref, name, xs).backward()
            with no_sync(model) if j < micro - 1 else contextlib.nullcontext():
                model(xs[rank], rank).backward()
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    got = full_state_dict(model, rank0_only=False)
    return max(((got[k] - v).abs().max() / v.abs().max()).item() for k, v in ref.state_dict().items())


@pytest.mark.parametrize("sync", ["backward", "step", "no_sync"])
@pytest.mark.parametrize("name", ["heads", "moe"])
def test_replicas_running_different_modules_train_as_one_process(name, sync):
    # rank r runs heads[r]: each shard group and each replica group ran other heads
    assert max(run(4, _train_hybrid, name, sync)) <= 1e-9


def test_a_hosted_module_joins_the_unit_of_its_host_whatever_the_sizes():
    from parts.partition.coordinator.units import choose_units
    # root -> heads (a container) -> heads.0, heads.1; the container hosted by the root
    units = choose_units([-1, 0, 1, 1], [[], [], [0], [1]], {0: 5, 1: 5}, 0, [False, False, True, True], {1: 0})
    assert units.unit == (0, 0, 0, 0) and units.members[0] == [0, 1]
    alone = choose_units([-1, 0, 1, 1], [[], [], [0], [1]], {0: 5, 1: 5}, 0, [False, False, True, True])
    assert alone.unit == (0, 1, 2, 3)  # unhosted: every head gathers its own
