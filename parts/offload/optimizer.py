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
(``parts.offload.backward_step``), and ``step()`` finishes.

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
gives bitwise the result of one in-memory step. Group options (``lr``...) stay shared, so
LR schedulers work on this wrapper as on the plain optimizer. Optimizers that couple
parameters (LBFGS, a global grad-norm clip inside ``step``) are not supported.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from parts.base.wrapper import OptimizerWrapper
from parts.offload import parking
from parts.offload._batch import Batch as _Batch, discard as _discard
from parts.offload.backward_step import BackwardStep
from parts.offload.lease import Stored
from parts.offload.plan import plan_chunks
from parts.offload.spares import Spares
from parts.offload.store import DiskStore

__all__ = ["OffloadedOptimizer"]

AHEAD_CHUNKS = 2
"""Chunks whose state a step reads ahead for the next one: the most within three chunks (see
the module docstring)."""


class OffloadedOptimizer(OptimizerWrapper):
    """Wraps ``optimizer``; its per-parameter state tensors live in ``store`` between steps."""

    drives_parked_tensors = True  # parking's plain-optimizer guard lets this one through

    def __init__(self, optimizer: torch.optim.Optimizer, store: DiskStore, *,
                 chunk_bytes: int = 64 << 20, prefix: str = "optim", across_steps: bool = True) -> None:
        super().__init__(optimizer)
        if not isinstance(store, DiskStore):
            raise TypeError(f"OffloadedOptimizer: store must be a parts.offload.DiskStore, got {type(store).__name__}")
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
        self.grad_scale: Optional[torch.Tensor] = None  # multiplies grads read from the store
        self.after_step: list[Callable[[list[torch.Tensor]], None]] = []  # per chunk, values loaded
        self.spares = Spares()  # buffers a chunk is done with, for a later chunk's reads (kept across steps)
        self.across_steps = across_steps
        self.ahead_chunks = AHEAD_CHUNKS  # at most AHEAD_CHUNKS: the memory bound
        self._behind: Optional[_Batch] = None  # the last step's last chunk's writes, in flight
        self._ahead: list[_Batch] = []  # the next step's first chunks' state, being read
        self.backward_step = BackwardStep(self, self.step_chunk_bytes)  # step_in_backward's state
        self._patch_step_function()
        self._offload_all()

    # ----------------------------------------------------- what schedulers and users read
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

    def state_of(self, p: torch.Tensor) -> dict[str, Any]:
        """The full state of ``p`` (offloaded tensors read back into fresh memory)."""
        self.settle()
        state = dict(self.optimizer.state.get(p, {}))
        state.update((name, self.state_of_key(p, name)) for name in self.stored_keys(p))
        return state

    # ------------------------------------------- one state tensor at a time (checkpoints)
    def stored_keys(self, p: torch.Tensor) -> list[str]:
        """Names of ``p``'s state tensors that live in the store."""
        return list(self._placed.get(id(p), {}))

    def write_state(self, p: torch.Tensor, name: str, value: torch.Tensor) -> None:
        """Store ``value`` (shaped like ``p``, on CPU) as ``p``'s state tensor ``name``; waits."""
        if value.shape != p.shape or value.device.type != "cpu":
            raise ValueError(f"OffloadedOptimizer: state {name!r} of parameter "
                             f"{self._index.get(id(p), '?')} must be a CPU tensor of shape "
                             f"{tuple(p.shape)}, got {tuple(value.shape)} on {value.device}")
        self.settle()
        self.optimizer.state.get(p, {}).pop(name, None)
        self.store.write(self._key(p, name), value.contiguous()).wait()
        self._placed.setdefault(id(p), {})[name] = (value.shape, value.dtype)

    def clear_state(self, p: torch.Tensor) -> None:
        """Forget ``p``'s state: the in-memory entries and the stored tensors."""
        self.settle()
        self.optimizer.state.pop(p, None)
        for name in self._placed.pop(id(p), {}):
            self.store.delete(self._key(p, name))

    # ------------------------------------------------------------------------ stepping
    def step_in_backward(self) -> contextlib.AbstractContextManager:
        """Inside, each parked parameter is stepped as soon as its grad shard lands during backward
        (``parts.offload.backward_step``): its grad never goes to the store, and its reads and
        writes run beside backward's compute. Call ``step()`` after that backward (it steps the
        rest and finishes); use it around the last micro-batch's backward only. The landed grads
        are consumed by the step, as if ``zero_grad()`` followed it (grads of earlier micro-batches
        in the store are added first). Not with ``BF16Optimizer``: its global norm and overflow
        check need every grad before any parameter steps."""
        return self.backward_step.session()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """Step every parameter with a grad, chunk by chunk, state streamed from and to the store
        (after ``step_in_backward``: finish the parameters stepped during backward, step the rest)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        early = bool(self.backward_step.landed)
        if early:  # the writes it leaves in flight join the last step's
            behind = self.backward_step.finish()
            behind.absorb(self._behind or _Batch())
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
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the grads, those of parked parameters in the store included."""
        self.optimizer.zero_grad(set_to_none)
        for p in self._params:
            parking.clear_grad(p)

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
            self.optimizer.step()
        finally:
            parking.driver.active = False
            for g, params in zip(self.optimizer.param_groups, saved):
                g["params"] = params

    def _write(self, chunk: list[torch.Tensor]) -> _Batch:
        """Start writing the chunk's state (and parked values) back; finish frees their memory."""
        batch = _Batch(self.spares)
        for p in chunk:
            for name, t in self._offloadable(p):
                batch.handles.append(self.store.write(self._key(p, name), t))
                batch.keep.append(self.optimizer.state[p].pop(name))
            if parking.parked(p) is not None:
                batch.handles.append(parking.save(p))
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

    # ------------------------------------------------------------------- state dicts
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's ``state_dict()`` with the offloaded tensors read back in."""
        return self._state_dict(lambda p, name, stored: self.state_of_key(p, name))

    def stored_state_dict(self) -> dict[str, Any]:
        """``state_dict()`` with each offloaded tensor as a ``parts.offload.lease.Stored`` (nothing
        read: a DCP checkpoint reads them one at a time); ``load_state_dict`` takes it back."""
        return self._state_dict(lambda p, name, stored: stored)

    def stored_state(self, p: torch.Tensor) -> dict[str, Any]:
        """The state of ``p``: in-memory entries, and offloaded tensors as ``Stored`` (nothing read)."""
        return {**self.optimizer.state.get(p, {}), **self._stored(p)}

    def _stored(self, p: torch.Tensor) -> dict[str, Stored]:
        return {name: Stored(self.store, self._key(p, name), shape.numel(), dtype)
                for name, (shape, dtype) in self._placed.get(id(p), {}).items()}

    def state_of_key(self, p: torch.Tensor, name: str) -> torch.Tensor:
        """Offloaded state tensor ``name`` of ``p``, read into fresh memory."""
        shape, dtype = self._placed[id(p)][name]
        out = parking.empty_for_io(shape, dtype)
        self.store.read(self._key(p, name), out).wait()
        return out

    def _state_dict(self, offloaded: Callable[[torch.Tensor, str, Stored], Any]) -> dict[str, Any]:
        self.settle()
        sd = self.optimizer.state_dict()
        for p in self._params:
            stored = self._stored(p)
            if stored:
                entry = sd["state"].setdefault(self._index[id(p)], {})
                entry.update({name: offloaded(p, name, st) for name, st in stored.items()})
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load as the wrapped optimizer does; state tensors shaped like their parameter go straight
        to the store one at a time (never all in memory at once); a ``Stored`` entry (from
        ``stored_state_dict``) must name this optimizer's own key: its bytes stay."""
        self.settle()
        state_dict, kept = self._take_stored(state_dict)
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        by_id = dict(zip(saved, self._params)) if len(saved) == len(self._params) else {}
        streamed = {i: {k: v for k, v in st.items() if k != "step" and _shaped_like(v, by_id[i])}
                    for i, st in state_dict["state"].items() if i in by_id}
        rest = dict(state_dict, state={i: {k: v for k, v in st.items() if k not in streamed.get(i, {})}
                                       for i, st in state_dict["state"].items()})
        self.optimizer.load_state_dict(rest)  # checks the groups; raises before anything changed
        for i, p in enumerate(self._params):
            for name in self._placed.pop(id(p), {}):
                if name not in kept.get(i, {}):
                    self.store.delete(self._key(p, name))
        for i, names in kept.items():
            self._placed.setdefault(id(self._params[i]), {}).update(names)
        for i, tensors in streamed.items():
            p = by_id[i]
            for name, value in tensors.items():  # cast as torch casts non-step state
                dtype = p.dtype if p.is_floating_point() else value.dtype
                self.write_state(p, name, value.to(device=p.device, dtype=dtype))
        self._offload_all()  # anything else shaped like its parameter (e.g. a 0-d param's step)

    def _take_stored(self, state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[int, dict]]:
        """``state_dict`` without its ``Stored`` entries (checked to be this optimizer's own), and
        ``{index: {name: (shape, dtype)}}`` of those entries."""
        kept: dict[int, dict[str, tuple[torch.Size, torch.dtype]]] = {}
        state = {i: dict(entry) for i, entry in state_dict.get("state", {}).items()}
        for i, entry in state.items():
            for name, value in list(entry.items()):
                if not isinstance(value, Stored):
                    continue
                placed = self._placed.get(id(self._params[i]), {}).get(name) if i < len(self._params) else None
                if placed is None or value.store is not self.store or value.key != self._key(self._params[i], name):
                    raise ValueError(f"OffloadedOptimizer.load_state_dict: state {name!r} of tensor #{i} is "
                                     f"{value!r}, not this optimizer's own stored tensor")
                kept.setdefault(i, {})[name] = placed
                del entry[name]
        return {**state_dict, "state": state}, kept


def _shaped_like(value: Any, p: torch.Tensor) -> bool:
    """A tensor the store holds for ``p``: shaped like it (its device is the parameter's)."""
    return isinstance(value, torch.Tensor) and value.shape == p.shape
