"""Reads of an attached model's weights between steps, and the one wrap it must not get.

The rule. Between steps, a parameter the coordinator keeps gathered (a persistent one) holds
its shard's current values (under ``MixedPrecision``, cast to ``param_dtype``): every optimizer
``step()`` (any ``torch.optim.Optimizer``, the parts wrappers included) is followed by a refresh
of the ones it changed (core/steps.py, steps.py), and parts' own writers
(``gathered(..., modifier_rank=...)``, ``load_full_state_dict``, ``load_sharded_state_dict``)
write the full tensor with the shard. A shard changed any other way (``meta(p).shard.add_(...)``
outside an optimizer step, or a ``step()`` taken during a forward or backward) leaves
the gathered copy stale until ``parts.partition.refresh(model)`` or the next step's start on
every rank. ``model.state_dict()`` checks: it raises rather than return a stale value. Other
reads (``named_parameters()``, a tensor the user kept) cannot be checked without a cost per op:
for them the rule is the contract. A parameter not gathered between steps (more elements than
``persistence_threshold``) has no full value to read: ``model.state_dict()`` raises, naming
``full_state_dict``, the collective that reads it; any op on it raises (core/param.py).

The wrap. ``DistributedDataParallel(model)`` would all-reduce full grads the coordinator
already reduce-scatters, and read parameters that are released between steps. DDP reads
``module._ddp_params_and_buffers_to_ignore`` first thing; the attached root's is a set that
refuses to be iterated, so the wrap raises with the fix in its message. A wrap of a module
holding it (its parent) is refused by core/ddp_guard.py.
"""

from __future__ import annotations

from typing import Any, Iterator

from torch import nn

from parts.partition.coordinator.table import ParamTable
from parts.partition.core.ddp_guard import no_ddp_message
from parts.partition.core.param import ParamStatus, is_stale

_DDP_ATTR = "_ddp_params_and_buffers_to_ignore"


class RefuseDDP:
    """The attached root's ``_ddp_params_and_buffers_to_ignore``: iterating it (what
    ``DistributedDataParallel.__init__`` does) raises, saying why and what to do instead."""

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError(no_ddp_message("DistributedDataParallel would wrap an attached model"))


class ReadGuard:
    """The read checks of one attached root: a ``state_dict`` pre-hook and the DDP refusal."""

    def __init__(self, root: nn.Module, table: ParamTable) -> None:
        self.root, self.table = root, table
        self.handle = root.register_state_dict_pre_hook(self._before_state_dict)
        self.had_ddp = _DDP_ATTR in root.__dict__
        if not self.had_ddp:
            root.__dict__[_DDP_ATTR] = RefuseDDP()

    def remove(self) -> None:
        """Detach: the model reads and wraps as a plain one again."""
        self.handle.remove()
        if not self.had_ddp and isinstance(self.root.__dict__.get(_DDP_ATTR), RefuseDDP):
            del self.root.__dict__[_DDP_ATTR]

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """Refuse ``state_dict()`` values that are not current: stale or not gathered."""
        if keep_vars:
            return
        for pid, m in self.table.records.items():
            if m.status is not ParamStatus.AVAILABLE:
                raise RuntimeError(_released_message(m, prefix, pid in self.table.persistent))
            if is_stale(m):
                raise RuntimeError(_stale_message(m, prefix))


def _released_message(m: Any, prefix: str, persistent: bool) -> str:
    why = ("not gathered yet (the first forward gathers it for good)" if persistent else
           "not gathered between steps (more elements than persistence_threshold)")
    return (f"parts.partition: {prefix or 'model.'}state_dict() reads full weights, but "
            f"{m.describe()} is sharded over {m.world_size} ranks and {why}. Read the weights "
            f"with `state = parts.partition.full_state_dict(model)` on every rank (Hugging Face: "
            f"then `model.save_pretrained(path, state_dict=state)` on rank 0), or checkpoint "
            f"with parts.partition.sharded_state_dict(model)")


def _stale_message(m: Any, prefix: str) -> str:
    return (f"parts.partition: {prefix or 'model.'}state_dict() would return a stale value of "
            f"{m.describe()}: its shard changed since it was gathered and no refresh followed "
            f"(a write outside an optimizer's step(), or a step() during a forward or backward). "
            f"Call parts.partition.refresh(model) on every rank first (the next forward "
            f"refreshes it too), or write shards inside an optimizer step or "
            f"`with parts.partition.gathered(params, modifier_rank=...)`")
