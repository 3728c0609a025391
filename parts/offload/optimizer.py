"""``OffloadedOptimizer``: any torch optimizer whose per-parameter state lives in a ``DiskStore``.

Between steps the wrapped optimizer's ``state[p]`` keeps only small entries (Adam's
``step`` counter); every state tensor shaped like its parameter (``exp_avg``,
``exp_avg_sq``, ``momentum_buffer``, ``sum``...) is in the store. Parameters that are
parked (``parts.offload.parking``: a partitioned shard on disk) also have their values and
their grad there. ``step()`` walks the parameters in chunks of about ``chunk_bytes``
(parameter, grad and state bytes; at most half the store's ``max_inflight_bytes``) as a
three-stage pipeline: the reads of chunk k+1 are in flight while chunk k is stepped, and
chunk k's writes run while chunk k+1 is stepped; chunk k-1's memory is freed once its
writes finished, so at most three chunks are held. Inside ``step_in_backward()`` each
parked parameter is stepped during backward instead, as its grad lands
(``parts.offload.backward_step``, through the methods under "the backward step's
interface"), and ``step()`` finishes: a transaction, committed once the ranks of ``group``
agree every grad is finite, else rolled back (module docstring of ``backward_step``).

The pipeline runs across steps (``across_steps=True``, the default): ``step()`` returns with
the last chunk's writes still in flight (*behind*) and the state of the next step's first
two chunks being read (*ahead*: state does not depend on grads), so both run during the next
forward and backward. The three-chunk bound holds: with a chunk of ``c`` bytes of which
``g`` grad, ``p`` parameter and ``s`` state, the most held is while the next step reads
its first two chunks' parameters and grads: ``(c - g)`` behind + ``2 s`` ahead + ``2 (p + g)``
= ``3c - g``. ``settle()`` waits for the writes and drops the reads ahead; the state dicts
and every change of state outside ``step()`` settle first; a parked value whose write is
behind stays loaded until it is done (``parking.drop`` and ``parking.load`` wait for it).

The wrapped optimizer steps a chunk by seeing only that chunk's parameters in its groups,
so any optimizer whose update of a parameter depends only on that parameter's grad and
state (AdamW, Adam, SGD, Adagrad, RMSprop, ... with the per-tensor or foreach kernels)
gives bitwise the result of one in-memory step. Group options (``lr``...) stay shared, so LR
schedulers work on this wrapper as on the plain optimizer. A plain ``Adam``/``AdamW`` is stepped
in place (``_adam``: torch's update, bitwise, without its per-step temporaries). Optimizers that
couple parameters (LBFGS, a global grad-norm clip inside ``step``) are not supported.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Optional, Sequence

import torch

from parts.base.wrapper import OptimizerWrapper
from parts.comm import GroupArg, ReduceOp, all_reduce, comm_tensor, group_info
from parts.offload import _heap, parking
from parts.offload._adam import InplaceAdam
from parts.offload._batch import Batch as _Batch, discard as _discard
from parts.offload._optim_state import Snapshot, StateAccess
from parts.offload._norms import NORM_TYPES, norm_orders
from parts.offload.backward_step import BackwardStep
from parts.offload._budget import check_budget
from parts.offload.plan import plan_chunks
from parts.offload.spares import Spares
from parts.offload.store import DiskStore

logger = logging.getLogger("parts.offload")

AHEAD_CHUNKS = 2
"""Chunks whose state a step reads ahead for the next one: the most within three chunks (see
the module docstring)."""


class OffloadedOptimizer(StateAccess, OptimizerWrapper):
    """Wraps ``optimizer``; its per-parameter state tensors live in ``store`` between steps."""

    drives_parked_tensors = True  # parking's plain-optimizer guard lets this one through

    def __init__(self, optimizer: torch.optim.Optimizer, store: DiskStore, *,
                 chunk_bytes: Optional[int] = None, prefix: str = "optim", across_steps: bool = True,
                 group: GroupArg = None) -> None:
        super().__init__(optimizer)
        if not isinstance(store, DiskStore):
            raise TypeError(f"OffloadedOptimizer: store must be a parts.offload.DiskStore, got {type(store).__name__}")
        chunk_bytes = store.budget.chunk_bytes if chunk_bytes is None else chunk_bytes
        if chunk_bytes < 1:
            raise ValueError(f"OffloadedOptimizer: chunk_bytes must be >= 1, got {chunk_bytes}")
        store.claim(prefix, self)
        self.store, self.chunk_bytes, self.prefix = store, int(chunk_bytes), prefix
        # the chunk step() uses: at most half the store's in-flight cap, so the next chunk's reads
        # and the last one's writes are in flight together (a larger chunk makes each submission
        # wait for the other kind to drain: benchmarks/bench_offload_chunks.py)
        self.step_chunk_bytes = max(1, min(self.chunk_bytes, store.max_inflight_bytes // 2))
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._placed: dict[int, dict[str, tuple[torch.Size, torch.dtype]]] = {}
        check_budget(self.store, self._params, self._cost)
        self.grad_scale: Optional[torch.Tensor] = None  # multiplies grads read from the store
        self.after_step: list[Callable[[list[torch.Tensor]], None]] = []  # per chunk, values loaded
        self.spares = Spares()  # buffers a chunk is done with, for a later chunk's reads (kept across steps)
        self.inplace = InplaceAdam()  # Adam/AdamW without fresh temporaries (one scratch buffer)
        self.across_steps = across_steps
        self.ahead_chunks = AHEAD_CHUNKS  # at most AHEAD_CHUNKS: the memory bound
        self._behind: Optional[_Batch] = None  # the last step's last chunk's writes, in flight
        self._ahead: list[_Batch] = []  # the next step's first chunks' state, being read
        self._staged: dict[int, list[str]] = {}  # id -> state names written under staged keys
        self.group = group  # the ranks whose steps during backward commit or roll back together
        self.skipped_steps = 0  # steps during backward rolled back for a non-finite grad
        self.backward_step = BackwardStep(self, self.step_chunk_bytes)  # step_in_backward's state
        self._patch_step_function()
        self._offload_all()

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's in-memory state (offloaded tensors are absent: ``state_of``)."""
        return self.optimizer.state

    def params_replaced(self) -> None:
        """Take the wrapped optimizer's params anew (a wrapper such as ``BF16Optimizer`` pointed
        its groups at fp32 masters); only before any state tensor was offloaded."""
        self.settle()
        if self._placed:
            raise RuntimeError("OffloadedOptimizer: its params were replaced after optimizer state "
                               "went to the store; wrap a fresh optimizer")
        self._params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._offload_all()

    # ------------------------------------------------------------------------ stepping
    def step_in_backward(self, norm_types: Sequence[float] = NORM_TYPES) -> contextlib.AbstractContextManager:
        """Inside, each parked parameter is stepped as soon as its grad shard lands during backward
        (``parts.offload.backward_step``): its grad never goes to the store, and its reads and
        writes run beside backward's compute. Call ``step()`` after that backward (it steps the
        rest and finishes); use it around the last micro-batch's backward only. The landed grads
        are consumed by the step, as if ``zero_grad()`` followed it (grads of earlier micro-batches
        in the store are added first). The step commits in ``step()`` if every rank's grads are
        finite, else it is rolled back and counted in ``skipped_steps``; an exception during the
        backward or ``zero_grad()`` rolls it back too. The old values and state stay in the store
        until the commit (the stepped parameters take twice their bytes on disk meanwhile).
        ``grad_norm`` counts the consumed grads by the norms kept of each, of order 2 and of the
        ``norm_types`` asked for (each order is a pass over the grad); a clip cannot scale them.
        Not with ``BF16Optimizer``: its global norm and overflow check need every grad before any step."""
        return self.backward_step.session(norm_orders(norm_types))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """Step every parameter with a grad, chunk by chunk, state streamed from and to the store
        (after ``step_in_backward``: finish the parameters stepped during backward and commit
        them if every rank's grads are finite, else roll them back and skip; step the rest)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        early = self.backward_step.open
        if early:
            finite = self.backward_step.finish() and self._rest_finite()
            if not self._agree_finite(finite):
                self._skip()
                return loss
            behind = self.backward_step.commit()  # its writes in flight are left behind
            if self._behind is not None:  # the last step's: they had this forward and backward
                self._behind.finish()
            self._behind = behind
        self.backward_step.drop_reads()
        if not early:
            self.backward_step.drop_kept()
        active = [p for p in self._params if p.grad is not None or parking.has_grad(p)]
        costs = [self._cost(p) for p in active]
        chunks = [[active[i] for i in run] for run in plan_chunks(costs, self.step_chunk_bytes)]
        self._pipeline(chunks)
        if early and self.across_steps:
            self.backward_step.read_ahead()  # the next backward's first landings
        _heap.step_done()
        return loss

    def _rest_finite(self) -> bool:
        """True if the grads in memory of the parameters not stepped during backward are finite."""
        return all(bool(torch.isfinite(p.grad).all()) for p in self._params if p.grad is not None)

    def _agree_finite(self, finite: bool) -> bool:
        """True if every rank of ``group`` found its grads finite (one all-reduce)."""
        info = group_info(self.group, "OffloadedOptimizer.step")
        flag = comm_tensor(0.0 if finite else 1.0, torch.float32, info)
        return all_reduce(flag, info, ReduceOp.MAX).item() == 0.0

    def _skip(self) -> None:
        self.backward_step.roll_back()
        self.skipped_steps += 1
        logger.warning("OffloadedOptimizer rank %d: non-finite grad in a step during backward: "
                       "rolled back, step skipped (%d skipped so far)",
                       group_info(self.group, "OffloadedOptimizer.step").rank, self.skipped_steps)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the grads, those of parked parameters in the store included; a step
        during backward not committed by ``step()`` is rolled back."""
        if self.backward_step.open:
            self.backward_step.roll_back()
        self.backward_step.forget_norms()
        self.optimizer.zero_grad(set_to_none)
        for p in self._params:
            parking.clear_grad(p)

    # ------------------------------------------------------- the backward step's interface
    @property
    def params(self) -> list[torch.Tensor]:
        """The tensors this optimizer steps, in group order (an index names their store keys)."""
        return self._params

    def index_of(self, p: torch.Tensor) -> int:
        """The index of ``p`` in ``params``."""
        return self._index[id(p)]

    def io_bytes(self, p: torch.Tensor) -> int:
        """Bytes a step of ``p`` holds: its value, grad and state tensors."""
        return self._cost(p)

    def start_reads(self, params: list[torch.Tensor]) -> _Batch:
        """Start reading ``params``' state and parked values (not grads); finishing the batch installs them."""
        return self._read(params, grads=False)

    def step_params(self, params: list[torch.Tensor]) -> None:
        """Step ``params`` alone (their values, grads and state in memory), then the ``after_step`` hooks."""
        self._step_only(params)
        for hook in self.after_step:
            hook(params)

    def stage(self, p: torch.Tensor) -> Snapshot:
        """What a step of ``p`` about to be staged changes outside the store (``roll_back`` restores it)."""
        placed = self._placed.get(id(p))
        state = self.optimizer.state.get(p)
        small = None if state is None else {k: v.clone() if isinstance(v, torch.Tensor) else v
                                            for k, v in state.items() if placed is None or k not in placed}
        return Snapshot(small, None if placed is None else dict(placed))

    def start_staged_writes(self, params: list[torch.Tensor]) -> _Batch:
        """Start writing stepped ``params`` under staged keys (``commit`` makes them current)."""
        return self._write(params, staged=True)

    def commit(self, params: list[torch.Tensor]) -> None:
        """Make the staged values and state of ``params`` current (renames in the store)."""
        for p in params:
            for name in self._staged.pop(id(p), []):
                self.store.rename(self._key(p, name) + parking.STAGED, self._key(p, name))
            if parking.parked(p) is not None:
                parking.commit(p)

    def roll_back(self, p: torch.Tensor, snapshot: Snapshot) -> None:
        """Forget ``p``'s staged step: delete its staged keys, restore ``snapshot``, empty its value."""
        for name in self._staged.pop(id(p), []):
            self.store.delete(self._key(p, name) + parking.STAGED)
        if snapshot.placed is None:
            self._placed.pop(id(p), None)
        else:
            self._placed[id(p)] = snapshot.placed
        if snapshot.state is None:
            self.optimizer.state.pop(p, None)
        else:
            self.optimizer.state[p] = snapshot.state
        p.grad = None
        if parking.parked(p) is not None:
            parking.unstage(p)

    def _cost(self, p: torch.Tensor) -> int:
        placed = self._placed.get(id(p))
        states = len(placed) if placed is not None else 2
        return p.numel() * p.element_size() * (2 + states)

    def _pipeline(self, chunks: list[list[torch.Tensor]]) -> None:
        try:
            self._run_pipeline(chunks)
            if not self.across_steps:
                self.settle()
        finally:
            carried = [] if self._behind is None else self._behind.keep
            self.spares.forget(carried + [t for batch in self._ahead for t in batch.keep])

    def _run_pipeline(self, chunks: list[list[torch.Tensor]]) -> None:
        writing, self._behind = self._behind, None
        reading = self._reads(chunks[0]) if chunks else None
        for k, chunk in enumerate(chunks):
            current = reading
            reading = self._reads(chunks[k + 1]) if k + 1 < len(chunks) else None
            current.finish()
            self._step_only(chunk)
            for hook in self.after_step:
                hook(chunk)
            previous, writing = writing, self._write(chunk)
            if previous is not None:
                previous.finish()
        self._behind = writing
        self._drop_ahead()  # reads ahead of chunks this step did not have
        if self.across_steps:  # the next step's first chunks are most likely this one's
            self._ahead = [self._read(chunk, state=True, rest=False) for chunk in chunks[:self.ahead_chunks]]

    def _reads(self, chunk: list[torch.Tensor]) -> _Batch:
        """The reads of a chunk: its state read ahead (if the next batch ahead is this chunk's), the rest now."""
        ids = tuple(map(id, chunk))
        while self._ahead:
            ahead = self._ahead.pop(0)
            if ahead.params == ids:
                return self._read(chunk, state=False, rest=True, batch=ahead)
            _discard(ahead, self.spares)  # another chunk (other grads this step): read again in its turn
        return self._read(chunk)

    def _drop_ahead(self) -> None:
        ahead, self._ahead = self._ahead, []
        for batch in ahead:
            _discard(batch, self.spares)

    def settle(self) -> None:
        """Wait for the writes a step left behind and drop the reads it started ahead (after this,
        the store holds all state and nothing of it is in flight); raises a failed write's error.
        The spare buffers stay for the next step (``spares.clear()`` frees them)."""
        behind, self._behind = self._behind, None
        try:
            if behind is not None:
                behind.finish()
        finally:
            self._drop_ahead()
            self.backward_step.drop_reads()
            self.backward_step.drop_kept()

    def _read(self, chunk: list[torch.Tensor], state: bool = True, rest: bool = True,
              batch: Optional[_Batch] = None, grads: bool = True) -> _Batch:
        """Start reading the chunk's state and (``rest``) parked values and (``grads``) stored grads;
        finish installs them."""
        batch = batch or _Batch(params=tuple(map(id, chunk)))
        for p in chunk:
            if state:
                self._read_state(p, batch)
            if rest and parking.parked(p) is not None:
                parking.prefetch(p)
                batch.after.append(lambda p=p: parking.load(p))
            if rest and grads and parking.has_grad(p):
                grad, handle = parking.load_grad(p, self.spares.empty)
                batch.handles.append(handle)
                batch.after.append(lambda p=p, grad=grad: self._install_grad(p, grad))
        return batch

    def _read_state(self, p: torch.Tensor, batch: _Batch) -> None:
        """Start reading ``p``'s stored state tensors; finishing ``batch`` installs them."""
        for name, (shape, dtype) in self._placed.get(id(p), {}).items():
            buf = self.spares.empty(shape, dtype)
            batch.handles.append(self.store.read(self._key(p, name), buf))
            batch.keep.append(buf)
            batch.after.append(lambda p=p, name=name, buf=buf: self._install_state(p, name, buf))

    def _install_state(self, p: torch.Tensor, name: str, buf: torch.Tensor) -> None:
        self.optimizer.state[p][name] = buf

    def _install_grad(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        if self.grad_scale is not None:
            grad.mul_(self.grad_scale.to(grad.device))  # the clip/unscale its wrapper decided
        p.grad = grad

    def _step_only(self, chunk: list[torch.Tensor]) -> None:
        """Step the wrapped optimizer with only ``chunk`` visible in its groups."""
        ids = {id(p) for p in chunk}
        saved = [g["params"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["params"] = [p for p in g["params"] if id(p) in ids]
        parking.driver.active = True
        try:
            if self.inplace.applies(self.optimizer):
                self.inplace.step(self.optimizer)
            else:
                self.optimizer.step()
        finally:
            parking.driver.active = False
            for g, params in zip(self.optimizer.param_groups, saved):
                g["params"] = params

    def _write(self, chunk: list[torch.Tensor], staged: bool = False) -> _Batch:
        """Start writing the chunk's state (and parked values) back, under staged keys if ``staged``;
        finish frees their memory."""
        batch, suffix = _Batch(self.spares), parking.STAGED if staged else ""
        for p in chunk:
            offloadable = self._offloadable(p)
            if staged:  # recorded first: a write that fails at submission (a full disk) is rolled back too
                self._staged[id(p)] = [name for name, _ in offloadable]
            for name, t in offloadable:
                batch.handles.append(self.store.write(self._key(p, name) + suffix, t))
                batch.keep.append(self.optimizer.state[p].pop(name))
            if parking.parked(p) is not None:
                batch.handles.append(parking.save(p, staged=staged))
                if p.grad is not None:
                    self.spares.give(p.grad)  # read from the store, used by the step: done with
                p.grad = None
                batch.after.append(lambda p=p: parking.release(p))
        return batch

    def _offloadable(self, p: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """State tensors of ``p`` shaped like it (recorded in ``_placed``)."""
        out = [(name, t) for name, t in self.optimizer.state.get(p, {}).items()
               if isinstance(t, torch.Tensor) and t.shape == p.shape and t.device.type == "cpu"]
        self._placed.setdefault(id(p), {}).update((name, (t.shape, t.dtype)) for name, t in out)
        return [(name, t.contiguous()) for name, t in out]

    def _key(self, p: torch.Tensor, name: str) -> str:
        return f"{self.prefix}/{self._index[id(p)]}/{name}"

    def _offload_all(self) -> None:
        """Move every state tensor now in memory to the store (after construction or a load)."""
        batch = _Batch()
        for p in self._params:
            if self.optimizer.state.get(p):
                for name, t in self._offloadable(p):
                    batch.handles.append(self.store.write(self._key(p, name), t))
                    batch.keep.append(self.optimizer.state[p].pop(name))
        batch.finish()
