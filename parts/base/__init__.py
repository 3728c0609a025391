"""parts.base: pure pieces every part may use and that use no part.

``ShardLayout`` (shard arithmetic, no torch.distributed), the device helpers and
``OptimizerWrapper`` (the delegation every torch-optimizer wrapper shares).
"""

from parts.base.device import accelerator_device, synchronize_accelerator
from parts.base.layout import ShardLayout
from parts.base.wrapper import OptimizerWrapper

__all__ = ["OptimizerWrapper", "ShardLayout", "accelerator_device", "synchronize_accelerator"]
