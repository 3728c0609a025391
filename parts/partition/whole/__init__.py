"""The whole-tensor path for shape-aware optimizers (Adafactor, Muon, per-tensor trust ratios)."""

from parts.partition.whole.leaves import ShapedShard, shaped_shard
from parts.partition.whole.paths import ELEMENT_WISE, needs_whole
from parts.partition.whole.route import route, stepper_of

__all__ = ["ShapedShard", "shaped_shard", "ELEMENT_WISE", "needs_whole", "route", "stepper_of"]
