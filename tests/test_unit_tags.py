"""Exponent tags (``parts.base.unit_tags``): summed over the units of a collective, they give the
count of nonzero units, whether one was not finite, and the one exponent exactly when all nonzero
units share it, for worlds packed in one word and worlds of four words."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from parts.base.fixed_point import GRID
from parts.base.unit_tags import tag, tag_words, untag

EXPONENTS = st.one_of(st.none(), st.integers(-976 // GRID, 960 // GRID).map(lambda k: k * GRID))


def _summed(units: list, world: int) -> list[int]:
    words = [tag(e, bad, world) for e, bad in units]
    return [sum(column) for column in zip(*words)]


@settings(max_examples=200, deadline=None)
@given(world=st.sampled_from([1, 2, 3, 7, 64, 1023, 1024, 5000]), data=st.data())
def test_summed_tags_give_the_units_the_nonfinite_flag_and_the_one_exponent(world: int, data) -> None:
    count = data.draw(st.integers(1, min(world, 40)))
    exponents = data.draw(st.lists(EXPONENTS, min_size=count, max_size=count))
    bad = data.draw(st.lists(st.booleans(), min_size=count, max_size=count))
    units = [(e, b and e is None) for e, b in zip(exponents, bad)]
    summed = _summed(units, world)
    assert len(summed) == tag_words(world) == (1 if world < 1024 else 4)
    nonzero = {e for e, _ in units if e is not None}
    assert untag(summed, world) == (sum(e is not None for e, _ in units), any(b for _, b in units),
                                    nonzero.pop() if len(nonzero) == 1 else None)


def test_a_full_world_of_the_extreme_exponents_fits_its_word() -> None:
    for world in (2, 1023):
        for exponent in (-976, 960):
            assert untag(_summed([(exponent, False)] * world, world), world) == (world, False, exponent)
        mixed = _summed([(-976, False)] * (world - 1) + [(960, False)], world)
        assert untag(mixed, world) == (world, False, None)
