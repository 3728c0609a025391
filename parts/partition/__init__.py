"""parts.partition: sharded parameters, gathered on demand."""

from parts.partition.layout import ShardLayout

__all__ = ["ShardLayout"]
