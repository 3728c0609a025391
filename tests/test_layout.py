"""ShardLayout: pure arithmetic properties over world sizes 1..64 and numel up to 1e9."""

import pytest
from hypothesis import given, strategies as st

from parts.partition import ShardLayout

layouts = st.builds(ShardLayout, numel=st.integers(0, 10**9), world_size=st.integers(1, 64),
                    align=st.integers(1, 256))


@given(layouts)
def test_ranges_are_disjoint_and_cover_in_rank_order(layout):
    covered = 0
    for rank in range(layout.world_size):
        start, stop = layout.range(rank)
        assert start == covered and start <= stop
        covered = stop
    assert covered == layout.numel


@given(layouts)
def test_sizes_padding_and_alignment(layout):
    assert layout.shard_numel * layout.world_size == layout.padded_numel >= layout.numel
    assert layout.shard_numel % layout.align == 0
    assert layout.padded_numel - layout.numel < layout.world_size * layout.align
    total_padding = sum(layout.padding(rank) for rank in range(layout.world_size))
    assert total_padding == layout.padded_numel - layout.numel
    assert all(0 <= layout.padding(rank) <= layout.shard_numel for rank in range(layout.world_size))


@given(st.integers(0, 10**9))
def test_world_one_without_alignment_has_no_padding(numel):
    layout = ShardLayout(numel, 1)
    assert layout.padded_numel == numel and layout.range(0) == (0, numel)


def test_uneven_example():
    layout = ShardLayout(15, 2)
    assert (layout.shard_numel, layout.range(0), layout.range(1), layout.padding(1)) == (8, (0, 8), (8, 15), 1)
    tiny = ShardLayout(2, 4)  # fewer elements than ranks: the last ranks hold padding only
    assert [tiny.range(r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(numel=-1, world_size=2), "numel must be >= 0"),
    (dict(numel=4, world_size=0), "world_size must be >= 1"),
    (dict(numel=4, world_size=2, align=0), "align must be >= 1"),
])
def test_bad_arguments_raise_value_error(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        ShardLayout(**kwargs)


def test_bad_rank_and_type():
    with pytest.raises(ValueError, match="rank 2 is outside"):
        ShardLayout(10, 2).range(2)
    with pytest.raises(TypeError, match="world_size must be an int"):
        ShardLayout(10, 2.0)


def test_layout_module_does_not_import_torch_distributed():
    import ast
    import inspect

    import parts.base.layout as module
    imported = {alias.name for node in ast.walk(ast.parse(inspect.getsource(module)))
                if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in getattr(node, "names", [])} | {
        node.module for node in ast.walk(ast.parse(inspect.getsource(module)))
        if isinstance(node, ast.ImportFrom)}
    assert not any("distributed" in (name or "") for name in imported)
