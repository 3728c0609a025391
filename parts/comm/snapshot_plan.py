"""DCP's save planning for ``parts.comm.Snapshots``: one checkpoint per node where each node's
ranks hold the whole state (a hybrid layout whose replicas are the nodes).

DCP writes a chunk that several ranks hold once, on one of them. In a hybrid layout whose
replica groups are the nodes, that spreads each replica's chunks over the nodes, so a lost
node's chunks would survive only in its buddy copy. ``NodePlanner`` plans the save as DCP does,
and where every node's ranks hold every chunk of the state, it plans each node apart instead:
each node writes every chunk once among its own ranks, with a ``.metadata`` of its own, so each
node's copy is a whole checkpoint and no buddy copy of the DCP files is needed (only each
rank's own values, a few KB, still go to the buddy node).
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed.checkpoint as torch_dcp


class NodePlanner(torch_dcp.DefaultSavePlanner):
    """``DefaultSavePlanner`` that plans each node of ``node_size`` ranks apart when each holds
    every chunk; ``node_metadata`` (on the coordinator) is then each node's metadata, else None."""

    def __init__(self, node_size: int) -> None:
        super().__init__()
        self.node_size = node_size
        self.node_metadata: Optional[list] = None

    def create_global_plan(self, all_plans: list) -> tuple[list, Any]:
        """DCP's global plan, or the nodes' plans (in rank order) where each node holds everything."""
        plans, metadata = super().create_global_plan(all_plans)
        nodes = [all_plans[start:start + self.node_size] for start in range(0, len(all_plans), self.node_size)]
        everything = _chunks(all_plans)
        if len(nodes) < 2 or any(_chunks(node) != everything for node in nodes):
            return plans, metadata
        planned = [torch_dcp.DefaultSavePlanner.create_global_plan(self, node) for node in nodes]
        self.node_metadata = [node_metadata for _, node_metadata in planned]
        self.metadata = metadata
        return [plan for node_plans, _ in planned for plan in node_plans], metadata


def _chunks(plans: list) -> set:
    """The (key, offset) of every item the plans write."""
    return {(item.index.fqn, tuple(item.index.offset or ())) for plan in plans for item in plan.items}
