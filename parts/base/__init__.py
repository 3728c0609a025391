"""parts.base: pure pieces every part may use and that use no part.

``ShardLayout`` (shard arithmetic, no torch.distributed) and the device helpers.
"""

from parts.base.device import accelerator_device, synchronize_accelerator
from parts.base.layout import ShardLayout

__all__ = ["ShardLayout", "accelerator_device", "synchronize_accelerator"]
