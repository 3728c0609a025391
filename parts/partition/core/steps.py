"""Optimizer steps on shards, counted, so a full tensor kept gathered is never used stale.

``is_stale`` compares a shard's version counter with the one it had when its full tensor
was gathered. Fused optimizer kernels (``torch.optim.AdamW(..., fused=True)``, Adam, SGD;
Hugging Face ``Trainer``'s default ``adamw_torch_fused``) write the shards in place without
bumping their version counters, so the persistent parameters (and any parameter left
gathered) would silently keep their pre-step values. So every shard whose version is taken
is linked to its record (a weak-keyed lookup: nothing is stored on the tensor, which must
stay picklable), and one process-wide optimizer step post-hook (torch's
``register_optimizer_step_post_hook``, registered the first time a version is taken) adds 1
to ``record.steps`` of every linked shard in the stepped optimizer's param groups; the
version includes that count. The hook only reads ``param_groups``: one lookup per
parameter per step, for every optimizer of the process.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

_links = WeakIdKeyDictionary()
"""Shard -> weak reference to its record. Process-wide because the hook below is; it
configures nothing and forgets shards (keys) and records (values) that are gone."""
_hook: dict[str, Any] = {"handle": None}


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Count one step on the record of every linked shard ``optimizer`` holds."""
    for group in optimizer.param_groups:
        for t in group["params"]:
            link = _links.get(t)
            record = link() if link is not None else None
            if record is not None:
                record.steps += 1


def watch(shard: torch.Tensor, record: Any) -> None:
    """Link ``shard`` to ``record`` (optimizer steps on it count in ``record.steps``)."""
    link = _links.get(shard)
    if link is None or link() is not record:
        _links[shard] = weakref.ref(record)
    if _hook["handle"] is None:
        _hook["handle"] = register_optimizer_step_post_hook(_after_step)
