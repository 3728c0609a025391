"""parts.offload: parameter shards and optimizer state on disk, streamed in and out.

``DiskStore(path)`` keeps one rank's tensors in scratch files with asynchronous reads and
writes on IO threads; ``OffloadedOptimizer`` steps any torch optimizer with its state in a
store, chunk by chunk; ``partitioned(remote_device=DiskStore(...))`` puts parameter shards
there and the coordinator reads them ahead along its trace.
"""

from parts.offload.store import DiskFullError, DiskStore, IOHandle, StoreStats

__all__ = ["DiskStore", "IOHandle", "StoreStats", "DiskFullError"]
