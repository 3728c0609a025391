"""parts.offload: parameter shards and optimizer state on disk, streamed in and out.

``DiskStore(path)`` keeps one rank's tensors in scratch files with asynchronous reads and
writes on IO threads; ``OffloadedOptimizer`` steps any torch optimizer with its state in a
store, chunk by chunk, or during backward as each grad lands (``step_in_backward``);
``partitioned(remote_device=DiskStore(...))`` puts parameter shards there and the coordinator
reads them ahead along its trace.

Example::

    store = DiskStore("/scratch")                       # one per rank
    optimizer = OffloadedOptimizer(torch.optim.AdamW(model.parameters()), store)
    loss.backward(); optimizer.step(); optimizer.zero_grad()
    with optimizer.step_in_backward():                  # shards on disk: step as grads land
        loss.backward()
    optimizer.step(); optimizer.zero_grad()
"""

from parts.offload.optimizer import OffloadedOptimizer
from parts.offload.plan import OffloadBudget, memory_bound, plan_chunks
from parts.offload.store import DiskFullError, DiskStore, IOHandle, StoreStats

__all__ = ["DiskStore", "IOHandle", "StoreStats", "DiskFullError", "OffloadedOptimizer",
           "OffloadBudget", "memory_bound", "plan_chunks"]
