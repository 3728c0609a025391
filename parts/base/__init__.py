"""parts.base: pure pieces every part may use and that use no part.

``ShardLayout`` (shard arithmetic, no torch.distributed), the device helpers, ``Timers``
(named timers that synchronise the accelerator; ``parts.observe.Timers`` adds the log across
ranks),
``OptimizerWrapper`` (the delegation every torch-optimizer wrapper shares),
``weak_method`` (a hook that does not keep its object alive) and ``StoragePool`` (freed CPU
memory kept for the next storage of its size: partition's gathers, offload's loads).
"""

from parts.base.device import accelerator_device, synchronize_accelerator
from parts.base.layout import ShardLayout
from parts.base.storage_pool import StoragePool
from parts.base.timers import Timer, Timers
from parts.base.weak import weak_method
from parts.base.wrapper import OptimizerWrapper

__all__ = ["OptimizerWrapper", "ShardLayout", "StoragePool", "Timer", "Timers", "accelerator_device",
           "synchronize_accelerator", "weak_method"]
