"""Fetch units: a block's parameters gathered and released together, as one collective."""

import torch
from harness import run
from hypothesis import given, settings
from hypothesis import strategies as st

import parts.comm.collectives as collectives
from parts.partition.coordinator.units import choose_units
from test_coordinator_models import GPT, batch, full_params, make_pair, train_sharded


# ------------------------------------------------------------------------ pure: choose_units
def test_units_cover_subtrees_up_to_the_limit():
    # root(0) -> a(1) -> [a1(2), a2(3)], b(4) -> [b1(5)]; sizes: a1 3, a2 4, b own 10, b1 2
    parents, own = [-1, 0, 1, 1, 0, 4], [[], [], [1], [2], [3], [4]]
    sizes = {1: 3, 2: 4, 3: 10, 4: 2}
    coverable = [False] + [True] * 5
    units = choose_units(parents, own, sizes, 7, coverable)
    assert units.unit == (0, 1, 1, 1, 4, 5)  # a (7 elements) is one unit; b (12) is not
    assert units.members[1] == [1, 2] and units.members[4] == [3] and units.members[5] == [4]
    assert choose_units(parents, own, sizes, 0, coverable).unit == tuple(range(6))  # leaf units
    assert choose_units(parents, own, sizes, 100, coverable).unit == (0, 1, 1, 1, 4, 4)
    assert choose_units(parents, own, sizes, 100, [True] * 6).unit == (0,) * 6  # a coverable root


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=12), st.integers(0, 60), st.randoms())
def test_every_parameter_is_fetched_by_exactly_its_unit(numels, limit, rnd):
    parents = [-1] + [rnd.randrange(i) for i in range(1, len(numels))]
    own = [[i] if n else [] for i, n in enumerate(numels)]
    sizes = {i: n for i, n in enumerate(numels) if n}
    units = choose_units(parents, own, sizes, limit, [i > 0 for i in range(len(numels))])
    for i, ids in enumerate(own):
        root = units.unit[i]
        assert units.is_root(root) and all(pid in units.members[root] for pid in ids)
    for root, ids in units.members.items():
        assert root == 0 or sum(sizes[pid] for pid in ids) <= max(limit, sizes.get(root, 0))


# ------------------------------------------------------------- a block is one collective
def _unit_steps(fetch_unit_size: int) -> dict:
    _, model = make_pair(GPT)
    issued = {"n": 0}
    real = collectives.all_gather_direct

    def counting(*args, **kwargs):
        issued["n"] += 1
        return real(*args, **kwargs)

    collectives.all_gather_direct = counting
    try:
        losses, co = train_sharded(model, 3, 2, persistence_threshold=0, max_reuse_distance=0,
                                   prefetch_bucket_size=0, fetch_unit_size=fetch_unit_size)
        issued["n"] = 0
        replayed = co.stats().trace_outcome
        model(*batch(3, 2, 0)).backward()  # one more step, its backend collectives counted
    finally:
        collectives.all_gather_direct = real
    stats = co.stats()
    params = full_params(model)
    blocks = [co.table.index[id(b)] for b in model.blocks]
    sets = {i: len(co.table.sets[i]) for i in blocks}
    co.detach()
    return dict(losses=losses, params=params, events=stats.trace_events,
                calls=stats.allgather_calls, issued=issued["n"], block_sets=sets,
                block_params=len(list(model.blocks[0].parameters())), replayed=replayed)


def test_a_block_is_fetched_as_one_collective():
    units, leaves = run(2, _unit_steps, 5_000_000)[0], run(2, _unit_steps, 0)[0]
    # each block is one unit: its root fetches all its parameters, its leaves nothing of their own
    assert set(units["block_sets"].values()) == {units["block_params"]}
    # the hooked calls: every block is 1 event per pass instead of its 6 leaf modules
    assert leaves["events"] - units["events"] == 2 * 3 * (6 - 1)
    # no prefetch: one gather per hooked call with parameters, each one backend collective
    # (all parameters of this model are small, so packed: parts.comm.packed)
    assert units["calls"] == units["issued"] and units["calls"] < leaves["calls"]
    assert leaves["issued"] == leaves["calls"]
    # the same math
    assert units["losses"] == leaves["losses"]
    assert all(torch.equal(a, b) for a, b in zip(units["params"], leaves["params"]))
    assert units["replayed"] == "replayed"


# ------------------------------------------------------ default knobs: fast and lean at once
class _Wide(torch.nn.Module):
    """Six blocks of 2M elements (two 1000 x 1000 linears): larger than the persistence threshold."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(1000, 1000, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(1000, 1000, bias=False)) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _default_schedule(**knobs) -> dict:
    from parts.partition import attach, meta, partitioned, shards
    torch.manual_seed(0)
    with partitioned():
        model = _Wide()
    co = attach(model, **knobs)
    optimizer = torch.optim.SGD(shards(model), lr=0.1)
    x = torch.randn(2, 1000, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    for _ in range(2):
        model(x).backward()
        optimizer.step()
        optimizer.zero_grad()
    stats = co.stats()
    gathers = [stats.param_gathers.get(meta(b[0].weight).id, 0) for b in model.blocks]
    out = dict(gathers=gathers, high=stats.live_high_water, shards=[s.clone() for s in shards(model)])
    co.detach()
    return out


def test_default_knobs_release_a_block_after_forward_unless_it_is_needed_soon():
    """Default knobs: a block whose backward is more than ``max_reuse_distance`` (5M)
    elements of other fetches away is released after its forward and gathered again for its
    backward; the last two (4M and 0 elements away) stay; prefetch reaches one unit ahead, so
    at most four of the six blocks are gathered at once. The math is that of keeping all."""
    lean, kept = run(2, _default_schedule)[0], run(2, _default_schedule, max_reuse_distance=10**9)[0]
    assert lean["gathers"] == [2, 2, 2, 2, 1, 1] and kept["gathers"] == [1] * 6
    block = 2 * 1000 * 1000
    assert lean["high"] <= 4 * block < kept["high"] == 6 * block
    assert all(torch.equal(a, b) for a, b in zip(lean["shards"], kept["shards"]))
