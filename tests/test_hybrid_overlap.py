"""The cross-replica mean overlapped with backward (``InFlight``): in place on grad shards that lie
side by side, on a packed copy otherwise, and exact when a grad shard receives more in flight."""

from __future__ import annotations

import torch
from torch import nn

from harness import run


def _in_flight(side_by_side: bool) -> list[list[float]]:
    """Two replicas (shard groups of one): grad shards rank + 1 (and 10 * (rank + 1) more for
    the first, landing while its all-reduce is in flight); the grad shards after the overlap and
    the sync that follows."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from parts.partition import partitioned
    from parts.partition.core.grads import accumulate_into
    from parts.partition.core.param import meta
    from parts.partition.core.replicas import InFlight, mark_pending, sync_replica_grads
    rank = dist.get_rank()
    with partitioned(mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))):
        model = nn.Linear(4, 3)
    records = sorted((meta(p) for p in model.parameters()), key=lambda m: m.id)
    sizes = [m.layout.shard_numel for m in records]
    buffer = torch.full((sum(sizes),), rank + 1.0)
    parts = torch.split(buffer, sizes) if side_by_side else [torch.full((n,), rank + 1.0) for n in sizes]
    for m, part in zip(records, parts):
        m.grad_shard = part
    mark_pending(records)
    flight = InFlight()
    flight.start(records)
    accumulate_into(records[0], torch.full((sizes[0],), 10.0 * (rank + 1)), True)  # lands in flight
    flight.finish()
    sync_replica_grads(records)
    return [m.grad_shard.tolist() for m in records]


def test_the_overlapped_mean_is_exact_in_place_packed_and_with_a_landing_in_flight():
    for side_by_side in (True, False):
        ranks = run(2, _in_flight, side_by_side)
        assert ranks[0] == ranks[1]  # replicas stay bitwise identical
        first, second = ranks[0]
        assert first == [1.5 + 15.0] * len(first)  # mean of 1, 2 plus the mean of 10, 20 landed on it
        assert second == [1.5] * len(second)
