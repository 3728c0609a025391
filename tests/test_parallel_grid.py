"""parts.parallel grid: pure GridLayout / tp_ranges properties and ParallelGrid's real groups."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from harness import RankFailure, run
from parts.parallel import GridLayout, ParallelGrid, shard_tensor, tp_ranges, unshard_tensor


@st.composite
def grids(draw):
    tp = draw(st.integers(1, 16))
    return GridLayout(tp * draw(st.integers(1, 16)), tp)


@given(grids())
def test_grid_groups_partition_the_world_and_cross_once(grid):
    tps, dps = grid.tp_groups(), grid.dp_groups()
    assert sorted(r for g in tps for r in g) == list(range(grid.world_size))
    assert sorted(r for g in dps for r in g) == list(range(grid.world_size))
    assert len(tps) == grid.dp and len(dps) == grid.tp
    assert all(len(set(t) & set(d)) == 1 for t in tps for d in dps)
    assert all(g == list(range(g[0], g[0] + grid.tp)) for g in tps)  # tp ranks are consecutive


@given(grids(), st.data())
def test_coords_and_position_are_inverse_and_match_the_groups(grid, data):
    pos = data.draw(st.integers(0, grid.world_size - 1))
    dp_rank, tp_rank = grid.coords(pos)
    assert grid.position(dp_rank, tp_rank) == pos
    assert grid.tp_groups()[dp_rank][tp_rank] == pos
    assert grid.dp_groups()[tp_rank][dp_rank] == pos


def test_grid_errors_name_both_numbers():
    with pytest.raises(ValueError, match=r"world size 6 .*tp=4"):
        GridLayout(6, 4)
    with pytest.raises(ValueError, match="outside"):
        GridLayout(4, 2).coords(4)
    with pytest.raises(TypeError, match="tp"):
        GridLayout(4, 2.0)


@given(st.integers(1, 8), st.integers(1, 4), st.integers(0, 6), st.data())
def test_tp_ranges_cover_each_chunk_evenly(tp, chunks, per, data):
    size = tp * chunks * per
    owned = sorted(i for r in range(tp) for a, b in tp_ranges(size, tp, r, chunks) for i in range(a, b))
    assert owned == list(range(size))
    rank = data.draw(st.integers(0, tp - 1))
    assert sum(b - a for a, b in tp_ranges(size, tp, rank, chunks)) == size // tp


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.integers(0, 1))
def test_shard_unshard_round_trip(tp, chunks, per, dim):
    shape = [5, 5]
    shape[dim] = tp * chunks * per
    full = torch.randn(shape)
    pieces = [shard_tensor(full, dim, tp, r, chunks) for r in range(tp)]
    assert torch.equal(unshard_tensor(pieces, dim, chunks), full)


def test_tp_ranges_rejects_uneven_split():
    with pytest.raises(ValueError, match="size 10 in 3 chunk"):
        tp_ranges(10, 2, 0, chunks=3)


def _grid_body(tp):
    grid = ParallelGrid(tp)
    me = torch.tensor([float(dist.get_rank())])
    tp_sum, dp_sum = me.clone(), me.clone()
    dist.all_reduce(tp_sum, group=grid.tp_group)
    dist.all_reduce(dp_sum, group=grid.dp_group)
    return (grid.dp_rank, grid.tp_rank, grid.dp_size, grid.tp_size, grid.tp_ranks, grid.dp_ranks,
            tp_sum.item(), dp_sum.item())


@pytest.mark.parametrize("world,tp", [(4, 1), (4, 2), (4, 4), (2, 1), (2, 2)])
def test_parallel_grid_coordinates_and_groups(world, tp):
    layout = GridLayout(world, tp)
    for rank, (dp_rank, tp_rank, dp_size, tp_size, tps, dps, tp_sum, dp_sum) in enumerate(run(world, _grid_body, tp)):
        assert (dp_rank, tp_rank) == layout.coords(rank) == (rank // tp, rank % tp)
        assert (dp_size, tp_size) == (world // tp, tp)
        assert tps == layout.tp_groups()[dp_rank] and dps == layout.dp_groups()[tp_rank]
        assert (tp_sum, dp_sum) == (sum(tps), sum(dps))  # the collectives really span those ranks


def _subgroup_body(tp):
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    grid = ParallelGrid(tp, group=halves[dist.get_rank() // 2])
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x, group=grid.dp_group)
    return grid.dp_rank, grid.tp_rank, grid.tp_ranks, grid.dp_ranks, x.item()


def test_parallel_grid_inside_a_subgroup():
    results = run(4, _subgroup_body, 1)
    assert [r[:4] for r in results] == [(0, 0, [0], [0, 1]), (1, 0, [1], [0, 1]),
                                        (0, 0, [2], [2, 3]), (1, 0, [3], [2, 3])]
    assert [r[4] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert [r[:4] for r in run(4, _subgroup_body, 2)] == [(0, 0, [0, 1], [0]), (0, 1, [0, 1], [1]),
                                                          (0, 0, [2, 3], [2]), (0, 1, [2, 3], [3])]


def _bad_tp_body():
    ParallelGrid(3)


def test_parallel_grid_rejects_world_not_divisible_by_tp():
    with pytest.raises(RankFailure, match=r"ParallelGrid\(tp=3\).*world size 4 is not divisible by tp=3"):
        run(4, _bad_tp_body)
