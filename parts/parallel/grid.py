"""ParallelGrid: the data-parallel and tensor-parallel process groups of this rank, no globals."""

from __future__ import annotations

from typing import Optional

from parts.comm import ProcessGroup, WeakGroup, global_rank

from . import _collectives as C
from .layout import GridLayout


class ParallelGrid:
    """Split the world (or ``group``) into ``dp`` x ``tp`` ranks; tp ranks are consecutive.

    Every rank of the *world* must construct its ``ParallelGrid`` at the same time with the
    same ``tp`` (each may pass its own ``group``): all groups of all grids are created by
    ``dist.new_group`` on every rank in one agreed order.

    Attributes: ``group`` (the parent), ``tp_group``, ``dp_group``, ``tp_rank``, ``dp_rank``,
    ``tp_size``, ``dp_size``, ``layout`` (the pure :class:`GridLayout`), ``tp_ranks`` and
    ``dp_ranks`` (global ranks of this rank's groups). The groups are held weakly (torch holds
    them until ``destroy_process_group``; see ``parts.comm.WeakGroup``).
    """

    group, tp_group, dp_group = WeakGroup(), WeakGroup(), WeakGroup()

    def __init__(self, tp: int, group: Optional[ProcessGroup] = None) -> None:
        parent = C.group_ranks(group)
        parents = [parent] if group is None else C.exchange_group_ranks(parent)
        layouts = {tuple(ranks): _layout(ranks, tp, group is None) for ranks in parents}
        self.group, self.layout = group, layouts[tuple(parent)]
        mine = self._create_all(parents, layouts, tuple(parent))
        self.tp_group, self.dp_group, self.tp_ranks, self.dp_ranks = mine
        self.dp_rank, self.tp_rank = self.layout.coords(parent.index(global_rank()))

    @staticmethod
    def _create_all(parents: list, layouts: dict, mine: tuple) -> tuple:
        """Create the tp then dp groups of every parent group; keep the ones of this rank."""
        found: tuple = ()
        me = global_rank()
        for ranks in parents:
            layout = layouts[tuple(ranks)]
            tp_lists = [[ranks[i] for i in pos] for pos in layout.tp_groups()]
            dp_lists = [[ranks[i] for i in pos] for pos in layout.dp_groups()]
            tp_groups, dp_groups = C.new_groups(tp_lists), C.new_groups(dp_lists)
            if tuple(ranks) == mine:
                t = next(i for i, r in enumerate(tp_lists) if me in r)
                d = next(i for i, r in enumerate(dp_lists) if me in r)
                found = (tp_groups[t], dp_groups[d], tp_lists[t], dp_lists[d])
        return found

    @property
    def tp_size(self) -> int:
        """Ranks in this rank's tensor-parallel group."""
        return self.layout.tp

    @property
    def dp_size(self) -> int:
        """Ranks in this rank's data-parallel group."""
        return self.layout.dp

    def __repr__(self) -> str:
        return (f"ParallelGrid(dp={self.dp_size}, tp={self.tp_size}, dp_rank={self.dp_rank}, "
                f"tp_rank={self.tp_rank}, tp_ranks={self.tp_ranks}, dp_ranks={self.dp_ranks})")


def _layout(ranks: list, tp: int, is_world: bool) -> GridLayout:
    """The grid of one parent group, with errors naming ``tp`` and that group."""
    what = "world" if is_world else f"group of ranks {list(ranks)}"
    try:
        return GridLayout(len(ranks), tp)
    except (TypeError, ValueError) as err:
        raise type(err)(f"ParallelGrid(tp={tp!r}) over the {what}: {err}") from None
