"""What a rank holds and sends, as plain records and formulas: no torch, no process group.

``Plan`` is what a dry run measures (``dry_run.py``); the formulas are the ZeRO paper's
(Rajbhandari et al., arXiv 1910.02054) for reference beside it, and ``link_split`` divides a
collective's bytes between the links inside and between nodes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

GIB = 1 << 30


@dataclass(frozen=True)
class Plan:
    """Per-rank memory and per-step traffic of one configuration (bytes; a steady-state step).

    ``params``: elements of the model (Ψ). ``param_bytes`` / ``grad_bytes`` /
    ``optimizer_bytes``: this rank's shards and optimizer state. ``persistent_bytes``: full
    copies of small parameters kept gathered. ``gathered_peak_bytes``: most full parameters
    gathered at once besides those. ``allgather_bytes`` / ``reduce_scatter_bytes`` /
    ``all_reduce_bytes``: what this rank receives (all-gather) or sends (reduce-scatter) per
    step, by ``parts.comm.counter``'s convention; in a hybrid layout (``shard_size`` ranks per
    shard group) the all-reduce is the cross-replica mean of the grad shards. Collective counts
    come from runs only (they depend on prefetch chunking) and take no part in comparing plans.
    """

    world_size: int
    params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    persistent_bytes: int
    gathered_peak_bytes: int
    allgather_bytes: int
    reduce_scatter_bytes: int
    all_reduce_bytes: int
    shard_size: Optional[int] = None  # ranks a parameter is sharded over (None: the whole world)
    allgather_calls: Optional[int] = field(default=None, compare=False)  # runs only: None from estimate
    reduce_scatter_calls: Optional[int] = field(default=None, compare=False)

    @property
    def model_state_bytes(self) -> int:
        """Shards of params and grads plus optimizer state: ZeRO's "model states" of this rank."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> int:
        """Model states plus every full parameter this rank may hold at once (no activations)."""
        return self.model_state_bytes + self.persistent_bytes + self.gathered_peak_bytes

    @property
    def step_bytes(self) -> int:
        """Everything this rank moves in one step."""
        return self.allgather_bytes + self.reduce_scatter_bytes + self.all_reduce_bytes

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain numbers (with the derived totals)."""
        return {**asdict(self), "model_state_bytes": self.model_state_bytes,
                "peak_bytes": self.peak_bytes, "step_bytes": self.step_bytes}


def peers(world_size: int, shard_size: int, ranks_per_node: int, replicas: bool) -> tuple[int, int]:
    """``(inside, between)``: a rank's peers in its shard group (or, with ``replicas``, its replica
    group) on its own node and on other nodes. Ranks are numbered node by node (as torchrun does);
    shard groups are blocks of ``shard_size`` consecutive ranks, replica groups one rank per block."""
    k = max(1, ranks_per_node)
    if replicas:
        members = world_size // shard_size
        same_node = max(1, k // shard_size) if shard_size < k else 1
    else:
        members, same_node = shard_size, min(shard_size, k)
    return same_node - 1, members - same_node


def link_split(nbytes: int, inside_peers: int, between_peers: int) -> tuple[int, int]:
    """``(inside, between)`` nodes of ``nbytes`` a collective moves, one equal part per peer."""
    total = inside_peers + between_peers
    if total == 0:
        return 0, 0
    inside = nbytes * inside_peers // total
    return inside, nbytes - inside


@dataclass(frozen=True)
class Reference:
    """Model-state bytes per rank of the classic layouts, for ``params`` elements over ``world_size``
    ranks with ``param_bytes`` per parameter and gradient and ``state_bytes`` of optimizer state
    per parameter (fp32 AdamW: 4, 4, 8; mixed precision with fp32 masters: 2, 2, 12)."""

    params: int
    world_size: int
    param_bytes: int = 4
    state_bytes: int = 8

    def ddp(self) -> int:
        """Everything replicated."""
        return self.params * (2 * self.param_bytes + self.state_bytes)

    def zero1(self) -> int:
        """Optimizer state sharded."""
        return 2 * self.params * self.param_bytes + math.ceil(self.params * self.state_bytes / self.world_size)

    def zero2(self) -> int:
        """Optimizer state and grads sharded."""
        return self.params * self.param_bytes + math.ceil(self.params * (self.param_bytes + self.state_bytes)
                                                          / self.world_size)

    def zero3(self) -> int:
        """Everything sharded."""
        return math.ceil(self.params * (2 * self.param_bytes + self.state_bytes) / self.world_size)

    def deepspeed_estimate(self, largest_layer: int) -> int:
        """DeepSpeed's ZeRO-3 estimate per GPU without offload (``estimate_zero3_model_states_mem_needs``,
        ``cpu_offload=False``): ``18 Ψ / N + 4 x largest layer``, knowing nothing of knobs or traffic
        (its ``additional_buffer_factor`` scales only its CPU estimate)."""
        return int(18 * self.params / self.world_size) + 4 * largest_layer
