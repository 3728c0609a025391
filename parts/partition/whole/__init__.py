"""The full-tensor paths for optimizers that are not element-wise: whole tensors stepped by owners
(Adafactor, Muon, per-tensor trust ratios) and every full tensor on every rank (optimizers that
couple tensors: D-adaptation, Prodigy, LBFGS, SAM)."""

from parts.partition.whole.leaves import ShapedShard, shaped_shard
from parts.partition.whole.paths import COUPLED, ELEMENT_WISE, needs_whole
from parts.partition.whole.probe import probe
from parts.partition.whole.route import route, stepper_of

__all__ = ["ShapedShard", "shaped_shard", "COUPLED", "ELEMENT_WISE", "needs_whole", "probe", "route", "stepper_of"]
