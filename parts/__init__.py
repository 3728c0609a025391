"""parts: ZeRO building blocks for PyTorch.

Each subpackage stands alone: ``parts.partition`` (sharded parameters and the
fetch/release coordinator), ``parts.optim`` (the flat-buffer BF16 optimizer),
``parts.checkpoint`` (partitioned activation checkpointing), ``parts.csrc``
(native flatten/copy ops) and ``parts.observe`` (memory and time reporting).
"""

__version__ = "0.1.0"
