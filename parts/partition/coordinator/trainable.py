"""``requires_grad`` alike on every rank, checked at each backward's start.

Which grads a rank reduces (the flat reduce-scatter's members, the per-parameter buckets)
follows ``requires_grad`` as read at the backward's start, so ranks whose flags differ issue
collectives of other sizes: a gloo abort or wrong grads. One all-reduce of a 16-byte fingerprint
of the flags finds a difference; only then are the flags exchanged, to name the parameter.

A backward under ``no_sync`` reduces within the shard group alone, so its check stays there too:
replicas may run other numbers of such backwards (as DDP allows), and only the backwards that
cross replicas (and the attach) compare the flags across them.
"""

from __future__ import annotations

from torch import nn

from parts.comm import GroupInfo, all_gather_objects, same_everywhere


class TrainableCheck:
    """Compares the ``requires_grad`` flags of an attached model's parameters across its ranks."""

    def __init__(self, params: list[nn.Parameter], names: list[str], scopes: list[GroupInfo],
                 within: GroupInfo) -> None:
        self.params, self.names, self.scopes, self.within = params, names, scopes, within

    def agree(self, across: bool = True) -> None:
        """Raise a ValueError on every rank, naming a parameter, if ranks set ``requires_grad`` otherwise:
        the ranks of every scope, or (``across`` False: a backward under ``no_sync``) of the shard group."""
        flags = tuple(p.requires_grad for p in self.params)
        for info in self.scopes if across else [self.within]:
            if info.world_size > 1 and not same_everywhere(hash(flags), info):
                _raise(all_gather_objects(flags, info.group), self.names, info)


def _raise(every: list[tuple], names: list[str], info: GroupInfo) -> None:
    """The first parameter whose flag differs among ``every`` rank's flags, named with the ranks."""
    k = next(k for k in range(len(names)) if len({flags[k] for flags in every}) > 1)
    on = {flag: [info.global_rank(r) for r, flags in enumerate(every) if flags[k] == flag] for flag in (True, False)}
    raise ValueError(f"attach: requires_grad of parameter '{names[k]}' differs across ranks (True on global "
                     f"ranks {on[True]}, False on {on[False]}); set requires_grad alike on every rank (as for "
                     f"DDP): each rank reduces the grads of the parameters requiring grad")
