"""parts: ZeRO building blocks for PyTorch.

Each part stands alone: ``parts.partition`` (sharded parameters and the fetch/release
coordinator), ``parts.offload`` (shards and optimizer state on disk), ``parts.optim`` (the
flat-buffer BF16 optimizer), ``parts.checkpoint`` (partitioned activation checkpointing),
``parts.parallel`` (tensor parallelism) and ``parts.observe`` (memory and time reporting).
Below them: ``parts.base`` (shard arithmetic, device helpers), ``parts.comm`` (process
groups, collectives, byte counter), ``parts.csrc`` (native copy ops) and ``parts._compat``
(torch-version shims and internals). See docs/architecture.md for who owns what.
"""

__version__ = "0.1.0"
