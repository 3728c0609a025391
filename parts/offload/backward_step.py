"""The optimizer step during backward: each parameter stepped as soon as its grad lands.

Why. After backward, a step of ``OffloadedOptimizer`` is nearly all IO: every parameter's
shard, grad and state read, its shard and state written back, with a fraction of a second
of compute beside it (``benchmarks/bench_offload.py``: 1.9 s offloaded against 0.3 s in
memory on one rank of a 125M model). Inside ``OffloadedOptimizer.step_in_backward()`` a
reduce-scattered grad shard that lands during backward is not written to the store: it
stays in memory while its parameter's shard and state are read, then the parameter is
stepped and written back, while backward goes on computing the layers below. The grad's
write and read disappear (8 of every 28 bytes an fp32 AdamW step moves per parameter) and
the rest of the IO runs beside backward's compute (as ZeRO-Offload overlaps its CPU step
with backward; Ren et al. 2021, sec. 5).

Reads ahead: grads land in about the same order every step (reverse forward order), so the
order of the last step's landings says which parameters come next; the reads of the next
ones run up to ``window_bytes`` (parameter, grad and state bytes) ahead of the landings. A
shard read ahead is held loaded (``parking.hold``), so the backward all-gather that uses it
just before its grad lands does not drop it: the step reuses those bytes. The other way
round too: a shard loaded for a backward all-gather stays loaded (``keeps``: its ``Parked.keep``)
if its grad lands within ``window_bytes`` of shard bytes after the landings so far, so its step
reads only its state (each shard is read twice a step, not three times).

The last landings' shards (first used by the next forward: up to ``window_bytes``) stay
loaded after their writes, for that forward's all-gathers, which drop them.

Memory (bytes above the model's, per rank), with ``m = max(window_bytes, largest parameter's
param + grad + state bytes)``: reads started ahead of their landing at most ``m`` (a read
starts only if it fits the window, or if none is ahead); landed parameters waiting for their
reads at most ``m`` (while they pass the window the oldest is stepped, waiting for its
reads); writes in flight at most ``m`` (the oldest is waited before more would pass it). In
forward the landed stage is empty and the kept shards take its place: three ``m`` at any
time, the three chunks of ``memory_bound``. Bitwise: a parameter's update depends only on
its own grad and state, so stepping it alone or in a chunk gives the same bits; the grad is
the same sum (a stored grad of earlier micro-batches plus the landed one, in that order).

A transaction: each parameter is written under staged keys (its old value and state stay in
the store) and its small in-memory state is snapshot before its step; ``finish`` says whether
every landed grad was finite, and the optimizer then ``commit``s (renames, no bytes move) or
``roll_back``s (staged keys deleted, snapshots restored, loaded values emptied), which an
exception during the backward also does before it propagates. The norms of each landed grad
(``_norms``: order 2, and those ``step_in_backward(norm_types=...)`` asks for) stay on its
parked record (``consumed``) until ``zero_grad``, for a
global grad norm to count grads that no longer exist. The optimizer is seen through
``Steppable``: the narrow interface ``OffloadedOptimizer`` gives this module.
"""

from __future__ import annotations

import contextlib
from collections import deque
from functools import partial
from typing import Any, Callable, Iterator, Optional, Protocol

import torch

from parts.offload import landing, parking
from parts.offload._norms import NORM_TYPES, grad_norms
from parts.offload._batch import Batch, discard, discard_quietly, finish_quietly
from parts.offload.spares import Spares
from parts.offload.staging import staging


class Steppable(Protocol):
    """What ``BackwardStep`` needs of its optimizer (``OffloadedOptimizer`` gives it)."""

    spares: Spares
    after_step: list[Callable[[list[torch.Tensor]], None]]

    @property
    def params(self) -> list[torch.Tensor]: ...
    def index_of(self, p: torch.Tensor) -> int: ...
    def io_bytes(self, p: torch.Tensor) -> int: ...
    def start_reads(self, params: list[torch.Tensor]) -> Batch: ...
    def step_params(self, params: list[torch.Tensor]) -> None: ...
    def stage(self, p: torch.Tensor) -> Any: ...
    def start_staged_writes(self, params: list[torch.Tensor]) -> Batch: ...
    def commit(self, params: list[torch.Tensor]) -> None: ...
    def roll_back(self, p: torch.Tensor, snapshot: Any) -> None: ...


class BackwardStep:
    """Reads ahead, landed grads and writes in flight of one optimizer's step during backward."""

    def __init__(self, optimizer: Steppable, window_bytes: int) -> None:
        self.opt, self.window_bytes = optimizer, int(window_bytes)
        self.order: list[int] = []  # parameter indices in the order their grads landed last time
        self.landed: list[int] = []  # this backward's landings so far
        self.stepped: set[int] = set()  # stepped since the last ``finish``
        self.open = False  # a session began and its step was neither committed nor rolled back
        self._reads: dict[int, tuple[Batch, int]] = {}  # index -> (reads started, their bytes)
        # index -> (landed grad, stored sum of earlier micro-batches or None, the handle of its read)
        self._grads: dict[int, tuple[torch.Tensor, Optional[torch.Tensor], Any]] = {}
        self._writes: deque[tuple[Batch, int]] = deque()  # (writes in flight, bytes), oldest first
        self._snapshots: dict[int, Any] = {}  # index -> what its staged step changed in memory
        self._norms: dict[int, dict[float, torch.Tensor]] = {}  # index -> its consumed grad's norms
        self.norm_types = NORM_TYPES  # the orders of those norms (``session``)
        self._cursor = 0  # position in ``order`` up to which reads were started
        self._tail: set[int] = set()  # the last landings: first used by the next forward
        self._kept: list[torch.Tensor] = []  # their shards, left loaded after their writes
        self._positions: dict[int, int] = {}  # index -> bytes landing before it (``_positions``)
        self.ahead_bytes = self.landed_bytes = self.writes_bytes = 0  # each at most one window or parameter

    # ------------------------------------------------------------- during backward
    @contextlib.contextmanager
    def session(self, norm_types: tuple[float, ...] = NORM_TYPES) -> Iterator[None]:
        """``OffloadedOptimizer.step_in_backward``: grads of parked parameters land in ``land``, their
        norms of ``norm_types`` kept; an exception inside rolls the step back before it propagates."""
        if self.open and self.landed:
            raise RuntimeError("OffloadedOptimizer.step_in_backward: the grads of the last backward "
                               "inside it were stepped but not committed; call step() (or zero_grad() "
                               "to discard that step) before the next backward")
        records = self._grad_records()
        if not self.open:
            self.forget_norms()
        self.norm_types = norm_types
        self.open = True
        self._positions = _positions(self.order, self.opt.params)
        for p, record in records:
            record.on_grad = partial(self.land, p)
            record.keep = partial(self.keeps, self.opt.index_of(p))
        try:
            with torch.no_grad():
                self.read_ahead()
            yield
        except BaseException:
            self.roll_back()
            raise
        finally:
            came = set(self.landed)
            for p, record in records:
                record.on_grad = record.keep = None
                if record.resident and record.holds == 0 and self.opt.index_of(p) not in came:
                    parking.release(p)  # kept for a landing that did not come

    def _grad_records(self) -> list[tuple[torch.Tensor, parking.Parked]]:
        """(parameter, the record its grads land in) of every parked parameter; raises for masters."""
        out = []
        for i, p in enumerate(self.opt.params):
            record = parking.parked(p)
            if record is None:
                continue
            if record.grad_of is not None or record.on_grad is not None:
                raise RuntimeError(f"OffloadedOptimizer.step_in_backward: parameter {i} (store key "
                                   f"{record.key!r}) is a BF16Optimizer master or already inside "
                                   f"step_in_backward(); a master steps only after the global grad "
                                   f"norm, so use step_in_backward with fp32 shards (AdamW(shards(model)))")
            out.append((p, record))
        return out

    @torch.no_grad()
    def land(self, p: torch.Tensor, grad: torch.Tensor, accumulate: bool) -> None:
        """``p``'s reduce-scattered grad shard arrived: keep it, read ``p`` and step what is ready."""
        i = self.opt.index_of(p)
        if i in self.stepped or i in self._grads:
            raise RuntimeError(f"OffloadedOptimizer.step_in_backward: the grad of parameter {i} "
                               f"(shape {tuple(p.shape)}) landed twice before step(); call step() "
                               f"after each backward inside step_in_backward()")
        if not self.landed:
            self.drop_kept()  # the last step's, which this backward's forward has used
        cost = self.opt.io_bytes(p)
        self._start(i)
        self.landed.append(i)
        self.ahead_bytes -= cost
        self.landed_bytes += cost
        stored, handle = None, None
        if accumulate and parking.has_grad(p):  # earlier micro-batches' sum, in the store
            stored, handle = parking.load_grad(p, self.opt.spares.empty)
            self._reads[i][0].handles.append(handle)
        fence = staging.fence(grad)  # a copy from the device filling it: the step waits for it
        if fence is not None:
            self._reads[i][0].handles.append(fence)
        self._grads[i] = (grad, stored, handle)
        parking.parked(p).consumed = partial(self.norms_of, i)
        while self.landed_bytes > self.window_bytes:
            self._step(self._landed_params(1))  # the oldest landed, waiting for its reads
        self.read_ahead()
        self.drain(block=False)

    def norms_of(self, i: int) -> dict[float, torch.Tensor]:
        """The norms of parameter ``i``'s consumed grad (landed, earlier micro-batches' sum added)."""
        if i not in self._norms:
            self._norms[i] = grad_norms(self._summed(i), self.norm_types)
        return self._norms[i]

    def _summed(self, i: int) -> torch.Tensor:
        """Landed grad ``i`` with the stored sum of earlier micro-batches added (its read waited)."""
        grad, stored, handle = self._grads[i]
        staging.wait(grad)
        if stored is not None:
            handle.wait()
            landed, grad = grad, stored.add_(grad.detach().reshape(stored.shape))
            self._grads[i] = (grad, None, None)
            landing.give_back(landed)
        return grad

    def forget_norms(self) -> None:
        """Forget the consumed grads' norms (``zero_grad``, or a new step's first backward)."""
        for i in self._norms:
            record = parking.parked(self.opt.params[i])
            if record is not None:
                record.consumed = None
        self._norms = {}

    def keeps(self, i: int) -> bool:
        """True if parameter ``i``'s shard, loaded for a backward all-gather, should stay loaded for
        its step: by the last landing order, its grad lands within ``window_bytes`` of shard bytes
        from the landings so far (its step then reads only its state)."""
        if i in self.stepped or i not in self._positions:
            return False
        done = len(self.landed)
        start = self._positions[self.order[done]] if done < len(self.order) else 0
        return self._positions[i] - start <= self.window_bytes

    def read_ahead(self) -> None:
        """Start the reads of the parameters expected next, up to ``window_bytes`` ahead (one at least)."""
        self._cursor = max(self._cursor, len(self.landed))
        while self._cursor < len(self.order):
            i = self.order[self._cursor]
            if i not in self._reads and i not in self.stepped:
                if self.ahead_bytes and self.ahead_bytes + self.opt.io_bytes(self.opt.params[i]) > self.window_bytes:
                    return
                self._start(i)
            self._cursor += 1

    def _start(self, i: int) -> None:
        """Start reading parameter ``i``'s state and parked value (held loaded till written)."""
        if i in self._reads:
            return
        p = self.opt.params[i]
        if parking.parked(p) is not None:
            parking.hold(p)
        self._reads[i] = self.opt.start_reads([p]), self.opt.io_bytes(p)
        self.ahead_bytes += self._reads[i][1]

    def _landed_params(self, limit: Optional[int] = None) -> list[torch.Tensor]:
        """The landed parameters not yet stepped, oldest first (at most ``limit``)."""
        waiting = self.landed[len(self.stepped):]
        return [self.opt.params[i] for i in waiting[:limit]]

    def drain(self, block: bool) -> None:
        """Step the landed parameters whose reads are done once they make a quarter window (all of
        them if ``block``), then start their writes."""
        chunk, ready = [], 0
        for i in self.landed[len(self.stepped):]:
            batch, cost = self._reads[i]
            p = self.opt.params[i]
            if not (block or (batch.done and parking.ready(p))):
                break
            chunk.append(p)
            ready += cost
        # fewer, larger steps: each call of the wrapped optimizer costs ~1 ms of Python
        if chunk and (block or ready >= self.window_bytes // 4):
            self._step(chunk)
        self._reap(0, block=False)

    def _step(self, chunk: list[torch.Tensor]) -> None:
        """Install the chunk's reads and grads, snapshot it, step it, start its staged writes."""
        ids = [self.opt.index_of(p) for p in chunk]
        landed = []  # the grad buffers the step consumes, for the store's reuse once written
        for i, p in zip(ids, chunk):
            batch, cost = self._reads.pop(i)
            batch.finish()
            landed.append(self._install_grad(p, i))
            self.landed_bytes -= cost
            self.stepped.add(i)
            self._snapshots[i] = self.opt.stage(p)
        self.opt.step_params(chunk)
        kept = [p for i, p in zip(ids, chunk) if i in self._tail]
        for i, p in zip(ids, chunk):
            if parking.parked(p) is not None and i not in self._tail:
                parking.unhold(p)  # the write's ``after`` releases it once saved
        # what the writes hold: parameter and state bytes (``io_bytes`` less the grad)
        nbytes = sum(self.opt.io_bytes(p) - p.numel() * p.element_size() for p in chunk)
        self._reap(nbytes, block=False)
        writes = self.opt.start_staged_writes(chunk)  # the grads are done with (p.grad is None)
        for buf in landed:
            landing.give_back(buf)
        for p in kept:  # stays loaded for the next forward's first all-gathers (its release drops it)
            writes.after.append(lambda p=p: parking.unhold(p))
        self._kept += kept
        self._writes.append((writes, nbytes))
        self.writes_bytes += nbytes

    def _install_grad(self, p: torch.Tensor, i: int) -> torch.Tensor:
        """``p.grad``: the landed grad, added to the stored sum of earlier micro-batches if any; its
        norms recorded; returns the tensor whose memory it is."""
        whole = self._summed(i)
        grad = whole.detach().reshape(p.shape)
        del self._grads[i]
        p.grad = grad
        if i not in self._norms:
            self._norms[i] = grad_norms(grad, self.norm_types)
        parking.clear_grad(p)  # consumed by this step
        return whole

    def _reap(self, room: int, block: bool) -> None:
        """Finish the writes that are done, and the oldest while ``room`` more bytes would pass the
        window (all if ``block``)."""
        while self._writes and (block or self._writes[0][0].done
                                or self.writes_bytes + room > self.window_bytes):
            batch, nbytes = self._writes.popleft()
            batch.finish()
            self.writes_bytes -= nbytes

    # ------------------------------------------------------------ at step() and after
    @property
    def pending(self) -> bool:
        """True while landed grads wait to be stepped."""
        return len(self.stepped) < len(self.landed)

    def finish(self) -> bool:
        """Step what landed; True if every grad stepped was finite (this rank's verdict)."""
        self.drain(block=True)
        return all(bool(torch.isfinite(self._norms[i][2.0])) for i in self.stepped)

    def commit(self) -> Batch:
        """Make the staged steps current; remember the landing order; return the writes still in
        flight as one batch."""
        self.opt.commit([self.opt.params[i] for i in self.stepped])
        if self.landed:
            self.order = self.landed
            self._tail = set(_tail(self.order, self.opt.params, self.window_bytes))
        behind = Batch(self.opt.spares)
        while self._writes:
            behind.absorb(self._writes.popleft()[0])
        self._reset()
        return behind

    def roll_back(self) -> None:
        """Undo the staged steps: wait their writes, delete them, restore what they changed in
        memory, empty every value loaded for them; the next backward starts clean."""
        while self._writes:
            finish_quietly(self._writes.popleft()[0])
        for i, (batch, _) in list(self._reads.items()):
            discard_quietly(batch, self.opt.spares)
            p = self.opt.params[i]
            if parking.parked(p) is not None:
                parking.unhold(p)
                parking.release(p)
        self._reads = {}
        for i in sorted(self.stepped):
            self.opt.roll_back(self.opt.params[i], self._snapshots[i])
        self._kept, self._grads = [], {}
        self.forget_norms()
        self._reset()

    def _reset(self) -> None:
        self.landed, self._cursor, self.stepped, self._snapshots = [], 0, set(), {}
        self.writes_bytes, self.open = 0, False
        if not self._reads:
            self.ahead_bytes = self.landed_bytes = 0

    def drop_kept(self) -> None:
        """Empty the shards left loaded for a forward that did not use them."""
        kept, self._kept = self._kept, []
        for p in kept:
            if parking.parked(p).holds == 0:
                parking.release(p)

    def drop_reads(self) -> None:
        """Forget the reads started for parameters whose grads did not land (nothing installed)."""
        if self.pending or (self.open and self.stepped):
            raise RuntimeError("OffloadedOptimizer: grads landed in a backward inside "
                               "step_in_backward() and were not stepped and committed yet; call "
                               "step() (or zero_grad() to discard them) first")
        reads, self._reads = self._reads, {}
        for i, (batch, _) in reads.items():
            discard(batch, self.opt.spares)
            p = self.opt.params[i]
            if parking.parked(p) is not None:
                parking.unhold(p)
                parking.release(p)
        self.ahead_bytes = self.landed_bytes = 0


def _positions(order: list[int], params: list[torch.Tensor]) -> dict[int, int]:
    """index -> the bytes of the parameters before it in ``order``."""
    out, total = {}, 0
    for i in order:
        out[i] = total
        total += params[i].numel() * params[i].element_size()
    return out


def _tail(order: list[int], params: list[torch.Tensor], nbytes: int) -> list[int]:
    """The last indices of ``order`` whose parameters' bytes sum to at most ``nbytes``."""
    out, total = [], 0
    for i in reversed(order):
        total += params[i].numel() * params[i].element_size()
        if total > nbytes:
            break
        out.append(i)
    return out
