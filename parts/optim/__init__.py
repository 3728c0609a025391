"""parts.optim: the flat-buffer mixed-precision (bf16/fp16) ZeRO-1 optimizer wrapper."""

from parts.optim.bf16_optimizer import BF16Optimizer
from parts.optim.layout import PARTITION_ALIGN, GroupLayout, plan_buckets
from parts.optim.loss_scaler import DynamicLossScaler

__all__ = ["BF16Optimizer", "DynamicLossScaler", "GroupLayout", "PARTITION_ALIGN", "plan_buckets"]
