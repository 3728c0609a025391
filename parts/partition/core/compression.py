"""``Compression``: which collectives of an attached model carry blockwise int8 / int4 codes.

The policy is plain data. ``attach(model, compression=policy)`` hands it to
``apply_compression``, which puts one ``CompressionState`` (the policy and the error-feedback
residuals) on every sharded parameter's record; the coordinator's collectives read it there:

* weights (``weights="int8"``): the coordinator's gathers (``gather(..., compute=True)`` and
  the flat persistent buffer) quantize each rank's fp32 shard and dequantize into the compute
  dtype (``parts.comm.compressed.all_gather_quantized``). The fp32 shards stay the masters, so
  the quantization error never accumulates in the weights. Gathers outside the coordinator
  (``gathered``, ``full_state_dict``) stay in full precision.
* node-local backward gathers (``attach(secondary_group=...)``, hpZ) with ``on="all"``: the
  primary gather's codes are kept with the gathered parameter (``ParamMeta.full_codes``), each
  rank keeps its node's share of them as its secondary shard, and the node all-gathers those
  codes (``all_gather_rows``): bitwise the values the primary gather gave. With
  ``on="replicas"`` they stay in the compute dtype: they never cross between nodes.
* grads (``grads="int8"`` or ``"int4"``): the grad reduce-scatters and a hybrid layout's
  cross-replica mean travel as codes with error feedback, one residual per parameter and hop;
  the grad shards still sum and accumulate in fp32 across micro-batches.

``on="all"``: every collective of the layout. ``on="replicas"``: only what crosses the slow
link: a hybrid layout's cross-replica mean (the shard group's collectives stay in full
precision), and over a group built with ``ranks_per_node`` the across-nodes hop of the grad
reduce-scatter (the node hop in full precision) and the weight gathers (both hops carry the
codes: the node hop forwards what crossed, so every rank computes with the same values).
In a layout with neither, ``on="replicas"`` compresses nothing.

Memory: error feedback keeps an fp32 residual of what each reduction could not send: for the
shard group's reduce-scatter the full (padded) grad of every parameter, 4 bytes per element
of the model on every rank (``on="all"``, or ``on="replicas"`` with ``ranks_per_node``: its
across hop holds ``1 / ranks_per_node`` of that); for the cross-replica mean about
``4 * (1 + 1 / replicas)`` bytes per element of this rank's shard. ``stats().residual_bytes``
reports it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Iterable, Optional, Sequence

import torch
from torch import nn

from parts.comm import GroupInfo, Waitable
from parts.comm.compressed import Codec, gather_shares, reduce_scatter_quantized
from parts.comm.quantize import BITS, ErrorFeedback
from parts.partition.core.param import ParamMeta, is_partitioned, meta

_WEIGHTS = (None, "int8")
_GRADS = (None, "int8", "int4")
_ON = ("all", "replicas")


@dataclasses.dataclass(frozen=True)
class Compression:
    """Which collectives carry blockwise codes: ``weights`` (None or "int8") for the weight
    all-gathers, ``grads`` (None, "int8" or "int4") for the grad reductions (error feedback),
    ``block`` elements per fp32 scale, ``on`` "all" collectives or only the "replicas" (slow) link."""

    weights: Optional[str] = None
    grads: Optional[str] = None
    block: int = 256
    on: str = "all"

    def __post_init__(self) -> None:
        for name, allowed in (("weights", _WEIGHTS), ("grads", _GRADS), ("on", _ON)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Compression: {name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"Compression: block must be a positive int (elements per fp32 scale), got {self.block!r}")


class CompressionState:
    """One attached model's compression: the policy, its codecs per collective and the
    error-feedback residuals (keyed by parameter id and hop)."""

    def __init__(self, policy: Compression) -> None:
        self.policy = policy
        self.feedback = ErrorFeedback()
        self._weights = Codec(8, policy.block) if policy.weights else None
        self._grads = Codec(BITS[policy.grads], policy.block) if policy.grads else None
        self.keep_codes = False  # a secondary store reuses the codes of the weight gathers

    def weights(self, info: GroupInfo) -> Optional[Codec]:
        """The codec of a weight all-gather over ``info`` (None: full precision)."""
        if self._weights is None or (self.policy.on == "replicas" and info.topology is None):
            return None
        return self._weights

    def node_weights(self) -> Optional[Codec]:
        """The codec of the node-local backward gathers of a ``secondary_group`` (None: compute dtype)."""
        return self._weights if self.policy.on == "all" else None

    def grads(self, info: GroupInfo) -> Optional[tuple[Optional[Codec], Codec]]:
        """``(node hop, flat or across hop)`` codecs of a grad reduce-scatter over ``info`` (None: full precision)."""
        if self._grads is None:
            return None
        if self.policy.on == "all":
            return self._grads, self._grads
        return (None, self._grads) if info.topology is not None else None

    def replicas(self) -> Optional[Codec]:
        """The codec of the cross-replica mean of a hybrid layout (None: full precision)."""
        return self._grads


def state_of(records: Sequence[ParamMeta]) -> Optional[CompressionState]:
    """The compression of the model these records belong to (None: off)."""
    return records[0].compression if records else None


def weight_codec(records: Sequence[ParamMeta], info: GroupInfo) -> Optional[Codec]:
    """The codec the coordinator's gather of ``records`` over ``info`` uses (None: full precision)."""
    state = state_of(records)
    if state is None or not all(m.shard.is_floating_point() for m in records):  # codes stand for real numbers
        return None
    return state.weights(info)


def keeps_codes(records: Sequence[ParamMeta]) -> bool:
    """True if a compressed gather of ``records`` keeps its codes on them (for a secondary store)."""
    state = state_of(records)
    return state is not None and state.keep_codes


def gather_wire_bytes(records: Sequence[ParamMeta], info: GroupInfo) -> Optional[list[int]]:
    """The bytes this rank receives for each of ``records`` in one coordinator gather over
    ``info`` if it travels as codes (the row's alignment counted on the last), else None."""
    codec = weight_codec(records, info)
    if codec is None:
        return None
    return gather_shares([m.layout.shard_numel for m in records], info.world_size, codec)


def compressed_grads(records: Sequence[ParamMeta], info: GroupInfo) -> bool:
    """True if the grad reduce-scatter of ``records`` over ``info`` travels as codes."""
    state = state_of(records)
    return state is not None and state.grads(info) is not None


def reduce_compressed(records: Sequence[ParamMeta], outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor],
                      info: GroupInfo, keys: Sequence[Hashable], average: bool,
                      async_op: bool) -> Optional[Waitable]:
    """The grad reduce-scatter of ``records`` as codes (``compressed_grads`` must hold), with
    error feedback under ``keys`` (one per piece)."""
    state = state_of(records)
    node, codec = state.grads(info)
    return reduce_scatter_quantized(outs, ins, info, codec, keys=keys, ef=state.feedback, node_codec=node,
                                    average=average, async_op=async_op)


def replica_codec(record: ParamMeta) -> Optional[Codec]:
    """The codec of ``record``'s cross-replica mean (None: full precision)."""
    state = record.compression
    return state.replicas() if state is not None and record.replica is not None else None


def residual_bytes(records: Iterable[ParamMeta]) -> int:
    """Bytes of error-feedback residuals held for these records' models."""
    states = {id(m.compression): m.compression for m in records if m.compression is not None}
    return sum(s.feedback.nbytes() for s in states.values())


def check_compression(policy: Optional[Compression]) -> Optional[Compression]:
    """``policy`` if it is a ``Compression`` or None, else a TypeError naming what was passed."""
    if policy is not None and not isinstance(policy, Compression):
        raise TypeError(f"FetchCoordinator: compression takes a parts.partition.Compression, "
                        f"got {type(policy).__name__}")
    return policy


def apply_compression(module: nn.Module, policy: Optional[Compression],
                      then: Optional[Callable[[], None]] = None) -> Optional[Callable[[], None]]:
    """Put ``policy``'s state on every sharded parameter of ``module``; returns the undo (which
    also runs ``then``), or ``then`` itself when ``policy`` is None."""
    if policy is None:
        return then
    state = CompressionState(policy)
    records = [meta(p) for p in module.parameters() if is_partitioned(p)]
    for m in records:
        m.compression = state

    def undo() -> None:
        for m in records:
            m.compression = None
        if then is not None:
            then()
    return undo
