"""All-gathers that know which ranks share a node: each byte crosses between nodes once per node.

A flat all-gather over ranks on several nodes (gloo's, or ``all_gather_direct``'s one
broadcast per rank) sends every rank's shard to every remote rank: with ``k`` ranks per node,
``k`` times what has to cross. Here, for a group of ``nodes x k`` ranks laid out node by node
(group rank ``n * k + i`` is local rank ``i`` of node ``n``), the all-gather runs in two hops:
first over ``across`` (local rank ``i`` of every node: each shard crosses to each other node
once), then over ``node`` (the ``k`` ranks of this node, which hold the rest between them),
and the blocks are put in group-rank order. The result is bitwise the flat all-gather's (it
only moves bytes).

``Topology.build(info, ranks_per_node)`` makes the two groups: like ``new_group`` every rank
of the default group must call it, with the same arguments, in the same order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from parts.comm.group import GroupInfo, group_info
from parts.comm.work import Waitable


def node_blocks(ranks: Sequence[int], ranks_per_node: int) -> bool:
    """Whether the global ``ranks`` (ascending) are whole nodes of ``ranks_per_node`` ranks each
    (global rank ``r`` on node ``r // ranks_per_node``, as launchers number them), two or more."""
    k = ranks_per_node
    if k < 2 or len(ranks) % k or len(ranks) == k or list(ranks) != sorted(ranks):
        return False
    blocks = [ranks[i:i + k] for i in range(0, len(ranks), k)]
    return all(list(b) == list(range(b[0], b[0] + k)) and b[0] % k == 0 for b in blocks)


def launcher_ranks_per_node(ranks: Sequence[int]) -> Optional[int]:
    """The launcher's ranks per node (``LOCAL_WORLD_SIZE``, as torchrun sets it) if ``ranks``
    span several whole nodes of it, else None: the default of ``partitioned(ranks_per_node=)``."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    except ValueError:
        return None
    return local if node_blocks(ranks, local) else None


@dataclass(frozen=True)
class Topology:
    """The node group and the across-nodes group of this rank within one process group."""

    node: GroupInfo
    across: GroupInfo
    nodes: int
    per_node: int

    @staticmethod
    def build(info: GroupInfo, ranks_per_node: int) -> Optional["Topology"]:
        """The topology of ``info``'s group with ``ranks_per_node`` ranks on each node (None when
        that is one node, or one rank per node: nothing to save)."""
        import torch.distributed as dist
        ranks = info.global_ranks()
        if ranks_per_node < 1 or len(ranks) % ranks_per_node:
            raise ValueError(f"ranks_per_node={ranks_per_node} does not divide the group's "
                             f"{len(ranks)} ranks ({ranks})")
        if ranks != sorted(ranks):
            raise ValueError(f"ranks_per_node: the group's global ranks {ranks} must be ascending, "
                             f"node after node")
        nodes = len(ranks) // ranks_per_node
        if nodes == 1 or ranks_per_node == 1:
            return None
        mine = {}
        for n in range(nodes):  # every rank makes every group, in the same order
            mine.setdefault("node", []).append(dist.new_group(ranks[n * ranks_per_node:(n + 1) * ranks_per_node]))
        for i in range(ranks_per_node):
            mine.setdefault("across", []).append(dist.new_group(ranks[i::ranks_per_node]))
        n, i = divmod(info.rank, ranks_per_node)
        return Topology(group_info(mine["node"][n], "ranks_per_node"),
                        group_info(mine["across"][i], "ranks_per_node"), nodes, ranks_per_node)


class TwoHop:
    """A two-hop all-gather in flight: the across-nodes hop issued; ``wait()`` finishes it, runs
    the node hop and puts the blocks in group-rank order into the output."""

    def __init__(self, first: Optional[Waitable], finish: "callable") -> None:
        self._first, self._finish = first, finish

    def wait(self) -> bool:
        """Block until the output holds every rank's shard."""
        if self._finish is None:
            return True
        if self._first is not None:
            self._first.wait()
        finish, self._finish = self._finish, None
        finish()
        return True


def two_hop_all_gather(out: torch.Tensor, inp: torch.Tensor, topo: Topology, gather: "callable",
                       async_op: bool) -> Optional[Waitable]:
    """``out`` (``nodes * per_node`` chunks of ``inp``'s size, group-rank order) from every rank's
    ``inp``; ``gather(out, inp, info, async_op)`` is the flat all-gather each hop uses."""
    s = inp.numel()
    across = torch.empty(topo.nodes * s, dtype=inp.dtype, device=inp.device)
    first = gather(across, inp, topo.across, True)

    def finish() -> None:
        local = torch.empty(topo.per_node * topo.nodes * s, dtype=inp.dtype, device=inp.device)
        gather(local, across, topo.node, False)
        out.view(topo.nodes, topo.per_node, s).copy_(local.view(topo.per_node, topo.nodes, s).transpose(0, 1))

    handle = TwoHop(first, finish)
    if async_op:
        return handle
    handle.wait()
    return None
