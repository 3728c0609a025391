"""parts.observe: memory and time reporting (memory_usage, storage_bytes, Timers)."""

from parts.observe.allocator import set_mmap_threshold, trim_allocator
from parts.base.device import accelerator_device, synchronize_accelerator
from parts.observe.memory import MemoryReport, memory_usage, reset_peak_memory, snapshot
from parts.observe.storage import StorageTracker, iter_tensors, storage_bytes
from parts.base.timers import Timer
from parts.observe.timers import Timers, log_timers

__all__ = ["MemoryReport", "memory_usage", "snapshot", "reset_peak_memory", "storage_bytes",
           "StorageTracker", "iter_tensors", "Timer", "Timers", "log_timers", "synchronize_accelerator",
           "accelerator_device", "set_mmap_threshold", "trim_allocator"]
