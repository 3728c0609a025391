"""OwnerPlan: every whole tensor has one owner, loads balanced by size, exchanges that add up."""

from hypothesis import given, strategies as st

from parts.base.owners import OwnerPlan, assign_owners

sizes = st.lists(st.integers(0, 10**6), max_size=40).map(tuple)
worlds = st.integers(1, 16)


@given(sizes, worlds)
def test_each_tensor_has_one_owner_and_loads_are_within_the_largest_tensor(sizes, world):
    owners = assign_owners(sizes, world)
    assert len(owners) == len(sizes) and all(0 <= o < world for o in owners)
    loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(world)]
    assert sum(loads) == sum(sizes)
    assert max(loads) - min(loads) <= max(sizes, default=0)
    assert assign_owners(sizes, world) == owners  # the same on every rank


@given(sizes, worlds)
def test_exchange_splits_match_between_senders_and_receivers(sizes, world):
    shards = tuple(-(-s // world) for s in sizes)
    plan = OwnerPlan(sizes, shards, world)
    for pieces in (1, 2, tuple(1 + j % 2 for j in range(len(sizes)))):
        sends = [plan.to_owners(r, pieces)[0] for r in range(world)]
        recvs = [plan.to_owners(r, pieces)[1] for r in range(world)]
        assert all(sends[s][d] == recvs[d][s] for s in range(world) for d in range(world))
    back_sends = [plan.from_owners(r)[0] for r in range(world)]
    back_recvs = [plan.from_owners(r)[1] for r in range(world)]
    assert all(back_sends[s][d] == back_recvs[d][s] for s in range(world) for d in range(world))
    assert sum(plan.load(r) for r in range(world)) == sum(sizes)


def test_largest_tensors_spread_first():
    assert assign_owners((10, 1, 9, 8), 2) == (0, 0, 1, 1)  # 10 | 9, 8 to rank 1 | 1 to rank 0
