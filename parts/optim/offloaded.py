"""``BF16Optimizer`` over shards on disk: its fp32 masters go to the shards' ``DiskStore``.

Used when the wrapped optimizer steps parked tensors (``parts.offload.OffloadedOptimizer``,
seen through ``parts.partition.core.disk``): each sharded parameter whose shard is parked
gets its master parked beside it (key ``master/<group>/<index>``), its grad being the
shard's stored grad. The wrapped optimizer then reads master, grad and state chunk by chunk;
after each chunk is stepped, ``write_back_chunk`` casts the chunk's masters into their
model-dtype shards (written to the store without reading them), so the step's write-back
happens inside the pipeline. The global grad norm reads the stored grads one at a time
(``stored_grad``: same tensors, same order, same arithmetic as in memory); a clip or unscale
coefficient is applied to each grad as the wrapped optimizer reads it (``grad_scale``).
"""

from __future__ import annotations

from typing import Callable

import torch

from parts.partition.core import disk

from .masters import Masters
from .sharded import ShardedParam


def setup(opt: Masters) -> None:
    """Park the masters of parked shards if the wrapped optimizer can step them, else raise; an
    ``OffloadedOptimizer`` inside takes the masters the wrapper put in its groups."""
    sharded = [(g, i, s) for g, group in enumerate(opt.sharded_groups) for i, s in enumerate(group)
               if disk.parked_version(s.record.shard) is not None]
    inner = opt.optimizer
    if not sharded:
        if disk.drives_parked(inner):  # state offloaded, masters in memory: it steps the masters
            inner.params_replaced()
        return
    if not disk.drives_parked(inner):
        raise TypeError(f"BF16Optimizer: parameter {sharded[0][2].name!r} has its shard in a DiskStore; "
                        f"wrap the inner optimizer so its fp32 masters and state go there too: "
                        f"BF16Optimizer(OffloadedOptimizer(torch.optim.AdamW(...), store))")
    for g, i, s in sharded:
        s.offload(f"master/{g}/{i}")
    inner.params_replaced()
    opt.drives_parked_tensors = True  # parking's plain-optimizer guard: this one steps them
    by_master = {id(s.master): s for _, _, s in sharded}
    inner.after_step.append(lambda chunk: write_back_chunk(by_master, chunk))


def write_back_chunk(by_master: dict, chunk: list[torch.Tensor]) -> None:
    """Cast the stepped (still loaded) masters of ``chunk`` into their shards on disk."""
    for master in chunk:
        s = by_master.get(id(master))
        if s is not None:
            s.write_back_loaded()


def lazy_grad(s: ShardedParam) -> Callable[[], torch.Tensor]:
    """A deferred read of an offloaded sharded param's grad (real elements)."""
    return s.stored_grad


def set_grad_scale(opt: Masters, grads: list, coef: torch.Tensor) -> list[torch.Tensor]:
    """Grads in memory (to be scaled now); the wrapped optimizer scales stored ones as it reads them."""
    if any(callable(g) for g in grads):
        opt.optimizer.grad_scale = coef if float(coef) != 1.0 else None
    return [g for g in grads if not callable(g)]
