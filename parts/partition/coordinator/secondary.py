"""Node-local backward gathers (ZeRO++ hpZ): ``attach(model, secondary_group=node_group)``.

When a unit's forward is over and its parameters are released, each rank keeps a secondary
shard of every one of them: block ``i`` (its rank in ``node_group``) of the ``k`` equal blocks
of the padded full tensor, as gathered (in the compute dtype). The ``k`` ranks of the node
hold the whole parameter between them, so the next gather of it in that step (backward's,
a checkpointed block's recompute) is an all-gather over ``node_group`` only: nothing crosses
between nodes, and the bytes are those the full gather would give (an all-gather only moves
them). A secondary shard goes as soon as the parameter's grad is complete in backward (a
frozen one: when its unit's backward is over), and every one at the end of backward or of
the step. It is never used once its shard changed: each one carries the shard's version
(``shard_version``: optimizer steps, fused ones too, and any write) and is dropped instead of
used when that differs; an optimizer step outside backward drops them all.

With ``Compression(weights="int8", on="all")`` a secondary shard is the codes and scales of
the ``w / k`` shards in its block, as the forward's compressed gather received them, and the
node all-gathers those codes: the values are bitwise the forward's, the node moves about a
quarter of the bytes. With ``on="replicas"`` it stays in the compute dtype (it never crosses
between nodes).

Memory: at most ``numel / k`` elements of each non-persistent parameter released in a
forward whose backward is still to come (``stats().secondary_bytes``: the peak of a step).

The node groups must split the shard group into equal blocks of consecutive ranks, as
``torchrun`` lays out nodes (checked at ``attach`` on every rank, one exchange of the ranks).
Where each node group holds the whole shard group (a hybrid layout sharded within the node),
backward gathers never leave the node already: ``secondary_group`` is then a no-op.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from parts._compat import in_backward
from parts.comm import GroupArg, GroupInfo, ProcessGroup, all_gather_objects, group_info, is_distributed
from parts.base.storage_pool import StoragePool
from parts.comm.compressed import Codec, to_wire
from parts.comm.quantize import Quantized
from parts.partition.core import steps as optimizer_steps
from parts.partition.core.gather import GatherHandle, gather_from, padded_full
from parts.partition.core.param import ParamMeta, ParamStatus, meta, shard_version, wanted_dtype
from parts.partition.coordinator.stats import StepCounters


def node_block_size(shard_ranks: Sequence[int], node_ranks: Sequence[Sequence[int]]) -> int:
    """``k`` if the node group of each member of the shard group (``node_ranks[j]``: global ranks
    of member ``j``'s node group) is the block of ``k`` consecutive shard-group ranks holding it,
    the same ``k`` for all; 0 if every node group holds the whole shard group (nothing to do).
    ValueError naming the ranks otherwise. Pure arithmetic."""
    whole = set(shard_ranks)
    covers = [whole <= set(ranks) for ranks in node_ranks]
    if all(covers):
        return 0
    sizes = {len(ranks) for ranks, cover in zip(node_ranks, covers) if not cover}
    for j, ranks in enumerate(node_ranks):
        k = len(ranks)
        block = list(shard_ranks[j // k * k:(j // k + 1) * k]) if k and len(shard_ranks) % k == 0 else None
        if covers[j] or len(sizes) > 1 or sorted(ranks) != block:
            raise ValueError(
                f"attach(secondary_group=...): the node groups must split the shard group (global "
                f"ranks {list(shard_ranks)}) into blocks of the same number of consecutive ranks, "
                f"one node each; rank {shard_ranks[j]} passed a group of global ranks {list(ranks)} "
                f"(every rank's: {[list(r) for r in node_ranks]})")
    return sizes.pop()


def _coded(block: torch.Tensor, m: ParamMeta) -> bool:
    """True if ``block`` is kept as codes: bytes standing for a floating-point parameter."""
    return block.dtype == torch.uint8 and m.shard.is_floating_point()


class SecondaryShards:
    """The secondary shards of one coordinator: stable id -> (block, the shard's version then)."""

    def __init__(self, node: GroupInfo, shard_group: GroupArg, counters: StepCounters,
                 codec: Optional[Codec] = None) -> None:
        self.node, self.counters, self.codec = node, counters, codec  # codec: blocks kept as codes
        self.shard_group = shard_group
        self.kept: dict[int, tuple[torch.Tensor, tuple, ParamMeta]] = {}
        self.nbytes = 0
        optimizer_steps.listen(self.after_optimizer_step)

    @staticmethod
    def build(records: Sequence[ParamMeta], secondary_group: GroupArg,
              counters: StepCounters) -> Optional["SecondaryShards"]:
        """The store for ``secondary_group`` over the shard group of ``records``, None where it
        would change nothing (one node, not distributed); checked and agreed on every rank."""
        if not isinstance(secondary_group, ProcessGroup):
            raise TypeError(f"attach(secondary_group=...): takes a process group (this node's ranks, "
                            f"e.g. torch.distributed.new_group), got {type(secondary_group).__name__}")
        if not records or not is_distributed():
            return None
        shard = records[0].info
        node = group_info(secondary_group, "attach(secondary_group=...)")
        others = [m for m in records if m.info.group is not shard.group]
        if others:
            raise ValueError(f"attach(secondary_group=...): {others[0].describe()} is sharded over "
                             f"another process group than {records[0].describe()}")
        every = all_gather_objects(node.global_ranks(), shard.group) if shard.world_size > 1 else []
        if shard.world_size == 1 or node_block_size(shard.global_ranks(), every) in (0, 1):
            return None
        state = records[0].compression
        codec = state.node_weights() if state is not None else None
        if codec is not None:
            state.keep_codes = True  # the weight gathers keep their codes for keep()
        return SecondaryShards(node, shard.group, counters, codec)

    def close(self) -> None:
        """Detach: drop every secondary shard, stop following optimizer steps."""
        self.drop_all()
        optimizer_steps.unlisten(self.after_optimizer_step)

    # ------------------------------------------------------------------------ keep
    def keep(self, pid: int, p: nn.Parameter) -> None:
        """Before ``p`` is released after a forward: keep this rank's block of its full tensor."""
        if pid in self.kept:
            return
        m = meta(p)
        full = padded_full(p) if m.info.group is self.shard_group else None
        if full is None:
            return
        if self.codec is not None and isinstance(m.full_codes, Quantized):
            block = self._codes_block(m.full_codes)
        else:
            size = full.numel() // self.node.world_size
            block = full[self.node.rank * size:(self.node.rank + 1) * size].clone()
        self.kept[pid] = (block, shard_version(m), m)
        self.nbytes += block.numel() * block.element_size()
        self.counters.secondary_bytes = max(self.counters.secondary_bytes, self.nbytes)

    def _codes_block(self, q: Quantized) -> torch.Tensor:
        """This rank's block of the gathered codes ``q`` (a row per shard): its rows as wire bytes."""
        rows = q.scales.shape[0] // self.node.world_size
        mine = slice(self.node.rank * rows, (self.node.rank + 1) * rows)
        return to_wire([Quantized(q.codes[mine], q.scales[mine], q.numel, q.block, q.bits)])

    def usable(self, pid: int, m: ParamMeta) -> bool:
        """True if ``pid`` has a secondary shard that matches its shard now (else it is dropped)."""
        item = self.kept.get(pid)
        if item is None:
            return False
        if (m.status is ParamStatus.NOT_AVAILABLE and item[1] == shard_version(m)
                and (item[0].dtype == wanted_dtype(m, True) or _coded(item[0], m))):
            return True
        self.drop([pid])
        return False

    # ---------------------------------------------------------------------- gather
    def gather(self, ids: Sequence[int], params: Sequence[nn.Parameter], async_op: bool,
               pool: Optional[StoragePool]) -> Optional[GatherHandle]:
        """All-gather the full tensors of ``ids`` (usable, sorted) from the secondary shards over the node."""
        self.counters.secondary_params += len(ids)
        blocks = [self.kept[pid][0] for pid in ids]
        coded = [_coded(self.kept[pid][0], self.kept[pid][2]) for pid in ids]
        handle = None
        for codes in (False, True):  # blocks kept as values, then as codes (the same split on every member)
            chosen = [k for k, c in enumerate(coded) if c is codes]
            if chosen:
                handle = gather_from([params[k] for k in chosen], [blocks[k] for k in chosen], self.node,
                                     async_op, pool, self.codec if codes else None)
        return handle

    def wire_bytes(self, pid: int) -> int:
        """Bytes this rank receives gathering ``pid`` over the node (``stats()``' convention)."""
        block = self.kept[pid][0]
        return (self.node.world_size - 1) * block.numel() * block.element_size()

    # ------------------------------------------------------------------------ drop
    def drop(self, ids: Sequence[int]) -> None:
        """Forget the secondary shards of ``ids`` (their backward used them, or they are stale)."""
        for pid in ids:
            item = self.kept.pop(pid, None)
            if item is not None:
                self.nbytes -= item[0].numel() * item[0].element_size()

    def drop_all(self) -> None:
        """Forget every secondary shard (backward or the step is over)."""
        self.kept.clear()
        self.nbytes = 0

    def after_optimizer_step(self) -> None:
        """An optimizer step ended: outside backward the shards changed, drop them all; inside
        (a step in backward) drop the ones whose shard it changed."""
        if not in_backward():
            self.drop_all()
            return
        self.drop([pid for pid, (_, version, m) in self.kept.items() if shard_version(m) != version])
