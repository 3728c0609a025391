"""``gathered(params, modifier_rank=None)``: full parameters inside a ``with`` block.

On entry the params are gathered (one collective; those already AVAILABLE are kept as
they are, unless their shard changed since they were gathered: those are fetched again). On normal exit:

* with ``modifier_rank=r``: rank ``r``'s full values are broadcast and re-sharded, so
  every rank's shard (and the full tensor of params that stay available) hold them;
* without it: changes are discarded. Params gathered on entry are released; params
  that were already AVAILABLE stay AVAILABLE and get back the values they had on entry
  (a copy is kept for the block), so a nested block cannot undo an outer one's writes.

Params that were AVAILABLE before stay AVAILABLE after, which makes nesting safe. If
the block raises, no collective is issued on the way out (the other ranks may not be
there): params gathered on entry are released, the others left as they are.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional

from torch import nn

from parts.partition.core.gather import gather, release
from parts.partition.core.param import ParamStatus, internal, is_partitioned, metas_sorted
from parts.partition.core.sharding import reshard

__all__ = ["gathered"]


@contextlib.contextmanager
def gathered(params: Iterable[nn.Parameter], modifier_rank: Optional[int] = None) -> Iterator[None]:
    """Full ``params`` inside the block; re-sharded from ``modifier_rank`` on exit (else discarded)."""
    params = [params] if isinstance(params, nn.Parameter) else list(params)
    pairs = metas_sorted(p for p in params if is_partitioned(p))
    if pairs and modifier_rank is not None and not 0 <= modifier_rank < pairs[0][1].world_size:
        raise ValueError(f"gathered: modifier_rank={modifier_rank} is outside the group of "
                         f"{pairs[0][1].world_size} ranks")
    before = [(p, m) for p, m in pairs if m.status is ParamStatus.AVAILABLE]
    ours = [(p, m) for p, m in pairs if m.status is not ParamStatus.AVAILABLE]
    gather([p for p, _ in pairs])  # also refreshes AVAILABLE params whose shard changed
    saved = [p.data.clone() for p, _ in before] if modifier_rank is None else []
    try:
        yield
    except BaseException:
        release([p for p, _ in ours])
        raise
    with internal:
        if modifier_rank is not None:
            reshard(pairs, modifier_rank, keep=True)
        else:
            for (p, _), value in zip(before, saved):
                p.data.copy_(value)
        release([p for p, _ in ours])
