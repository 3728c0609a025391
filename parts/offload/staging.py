"""Copies between the host and an accelerator off the compute stream, and the rule that no
host memory is read, reused or freed before the copy that touches it is done.

* ``to_host(src, out)``: a grad that landed on the accelerator goes into host memory ``out``
  (pinned where an accelerator exists: ``host_empty``) on a side stream that first waits for
  the compute stream's work so far; an event is recorded after the copy, and ``src`` is kept
  from the allocator until the side stream is past it.
* ``to_device(src, device, dtype)``: a shard in host memory goes to the accelerator on a copy
  stream; the compute stream waits for the copy's event, so the all-gather queued after it
  reads the copied bytes, and the copy overlaps whatever compute was queued before.

Each copy leaves a ``Copy`` (an event, waitable like a store's ``IOHandle``) on the host memory
it reads or writes: ``fence(t)`` finds it through any view of that memory, ``wait(t)`` blocks
until it is done. The store waits a fence on its IO thread before writing the bytes; a parked
tensor's ``drop`` waits before its memory goes back to the store's pool; a step waits before it
reads a landed grad; and, from the first copy on, a process-wide optimizer step pre-hook waits
the fences of the parameters an optimizer is about to change in place (shards in host memory
that a copy to the device may still read). On a machine without an accelerator, and for CPU tensors, nothing here
acts: ``to_device`` is ``src.to(device, dtype, non_blocking=True)``, ``to_host`` is never
reached, and ``host_empty`` allocates ordinary memory.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch

from torch.optim.optimizer import register_optimizer_step_pre_hook

from parts._compat import can_swap_storage_data, swap_storage_data
from parts.base.device import accelerator_device
from parts.base.storage_pool import StoragePool


class Copy:
    """A copy queued on a stream: ``done`` asks its event, ``wait()`` blocks until it finished."""

    def __init__(self, event: Any) -> None:
        self._event = event

    @property
    def done(self) -> bool:
        """True once the copy has finished (``wait`` would not block)."""
        return bool(self._event.query())

    def wait(self) -> None:
        """Block this thread until the copy has finished."""
        self._event.synchronize()


class DeviceStreams:
    """The accelerator side of staging: one side stream per device and direction, events, pinned memory."""

    def __init__(self) -> None:
        self._streams: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def accelerated(self, device: torch.device) -> bool:
        """True if ``device`` is an accelerator whose copies run on streams."""
        return device.type not in ("cpu", "meta")

    def pins(self) -> bool:
        """True if host memory for copies should be pinned (an accelerator exists)."""
        return accelerator_device() is not None

    def _module(self, device: torch.device) -> Any:
        return torch.get_device_module(device.type)

    def _stream(self, device: torch.device, role: str) -> Any:
        key = (str(device), role)
        with self._lock:
            if key not in self._streams:
                self._streams[key] = self._module(device).Stream(device=device)
            return self._streams[key]

    def h2d(self, src: torch.Tensor, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        """``src`` (host) copied to ``device`` in ``dtype`` on the copy stream; the compute stream
        waits the returned event before its next work."""
        mod = self._module(device)
        current, copy = mod.current_stream(device), self._stream(device, "h2d")
        with mod.stream(copy):
            out = torch.empty(src.shape, dtype=dtype, device=device)
            out.copy_(src, non_blocking=True)
            event = mod.Event()
            event.record(copy)
        current.wait_event(event)
        out.record_stream(current)  # allocated on the copy stream, used and freed on the compute one
        return out, event

    def d2h(self, src: torch.Tensor, out: torch.Tensor) -> Any:
        """Copy ``src`` (on an accelerator) into host ``out`` on the side stream, after the compute
        stream's work so far; the returned event follows the copy."""
        mod = self._module(src.device)
        current, side = mod.current_stream(src.device), self._stream(src.device, "d2h")
        side.wait_stream(current)
        with mod.stream(side):
            out.copy_(src, non_blocking=True)
            event = mod.Event()
            event.record(side)
        src.record_stream(side)  # its memory is not reused before the side stream has read it
        return event

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised 1-D host memory, pinned if ``pins()``."""
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.pins())


class Staging:
    """Copies between host and accelerator with their fences, on ``streams`` (``DeviceStreams``)."""

    def __init__(self, streams: Any = None) -> None:
        self.streams = streams if streams is not None else DeviceStreams()
        self._fences: dict[int, Copy] = {}  # host storage address -> the copy reading or writing it
        self._lock = threading.Lock()
        self._step_hook: Any = None

    def _key(self, t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    def _prune(self) -> None:
        """Forget the copies that are done (a waiter that held the ``Copy`` itself left them)."""
        with self._lock:
            for key in [k for k, copy in self._fences.items() if copy.done]:
                del self._fences[key]

    def _remember(self, t: torch.Tensor, copy: Copy) -> None:
        with self._lock:
            self._fences[self._key(t)] = copy
            if self._step_hook is None:
                self._step_hook = register_optimizer_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Optimizer step pre-hook: wait for the copies still reading the parameters it changes."""
        if self._fences:
            self._prune()
        if self._fences:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    self.wait(p)

    def fence(self, t: torch.Tensor) -> Optional[Copy]:
        """The copy still touching ``t``'s host memory (any view of it), or None (always for a
        tensor subclass such as a DTensor: no copy here has its memory)."""
        if not self._fences or t.device.type != "cpu" or type(t) not in (torch.Tensor, torch.nn.Parameter):
            return None
        with self._lock:
            copy = self._fences.get(self._key(t))
            if copy is not None and copy.done:
                del self._fences[self._key(t)]
                return None
        return copy

    def wait(self, t: torch.Tensor) -> None:
        """Block until no copy touches ``t``'s host memory (a no-op if none does)."""
        copy = self.fence(t)
        if copy is None:
            return
        copy.wait()
        with self._lock:
            if self._fences.get(self._key(t)) is copy:
                del self._fences[self._key(t)]

    def wants_host(self, t: torch.Tensor) -> bool:
        """True if ``t`` lives on an accelerator (``to_host`` moves it to host memory)."""
        return self.streams.accelerated(t.device)

    def to_host(self, src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy accelerator tensor ``src`` into host ``out`` (same numel) off the compute stream;
        ``out`` carries the copy's fence until it is waited. Returns ``out`` shaped like ``src``."""
        out = out if out.shape == src.shape else out.view(src.shape)  # the same object keeps its attributes
        self.wait(out)  # the memory may still be read by an earlier copy
        self._remember(out, Copy(self.streams.d2h(src.detach(), out)))
        return out

    def to_device(self, src: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``src`` on ``device`` in ``dtype``: from host memory to an accelerator on the copy stream
        (``src``'s memory fenced until the copy is done), else ``src.to(device, dtype, non_blocking=True)``."""
        if src.device.type != "cpu" or not self.streams.accelerated(device):
            return src.to(device, dtype, non_blocking=True)
        out, event = self.streams.h2d(src, device, dtype)
        self._remember(src, Copy(event))
        return out

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised 1-D host memory for copies (pinned where an accelerator exists)."""
        return self.streams.host_empty(numel, dtype)

    def pins(self) -> bool:
        """True if host memory for copies is pinned here."""
        return self.streams.pins()

    def fill(self, storage: torch.UntypedStorage, pool: StoragePool, nbytes: int) -> None:
        """Give empty ``storage`` ``nbytes``: a block ``pool`` kept, else fresh memory, pinned
        where an accelerator exists (copies from it to the device then run asynchronously)."""
        if pool.take_into(storage, nbytes):
            return
        if self.pins() and can_swap_storage_data() and storage.nbytes() == 0:
            swap_storage_data(storage, self.host_empty(nbytes, torch.uint8).untyped_storage())
        else:
            storage.resize_(nbytes)


staging = Staging()
"""The process-wide staging every part of offload uses (its state: the fences of copies in flight)."""
