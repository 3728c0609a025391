"""The fetch/release coordinator: ZeRO-3 training with ordinary training code.

``attach(model)`` hooks the root, every fetch unit (units.py: a block, a submodule's own
parameters) and modules using others' (external parameters); modules inside a unit fetch
only when called outside it:

* before a unit's forward its parameters are gathered (one group of collectives) and
  released after it, unless kept for reuse or persistent; before its backward (a pre-hook on
  the autograd nodes of the forward's output tensors, found in tuples, dicts and dataclasses)
  they are gathered again;
* grads are reduce-scattered into fp32 grad shards (reduce.py) once per backward, after a
  parameter's last use (``register_post_accumulate_grad_hook``: tied weights once), summed
  over micro-batches, in buckets of ``reduce_bucket_size`` elements (async with
  ``overlap_comm``; all have landed when ``backward()`` returns);
* the first step of each phase (``train``, ``eval/no_grad``, ...) records the submodule order;
  later steps prefetch ahead along it with async gathers. A step that leaves the trace (a
  skipped block, another branch) fetches on demand from there on and becomes the new trace
  (the last 4 distinct traces of a phase are kept, so alternating graphs replay both).
  A "step" is one or more forwards and the backward that follows (or one no-grad forward).

What all ranks must share: the same fetch units run in the same order (every fetch is a
collective); modules gathered with others may run on some ranks only (uneven.py: zero grads
where a rank lacks one; collectives that met other modules' raise ``RankDivergence``).
``debug=True`` makes the ranks agree on (phase, step, event, module) before every collective of
a step (fetch, prefetch, refresh, reduce-scatter), naming what each rank was doing, instead of hanging.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from functools import partial
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn

from parts._compat import functorch_active, in_backward
from parts.base.weak import weak_method
from parts.comm import GroupArg, WeakGroup
from parts.partition.construction.construct import drop_forward_check, restore_forward_check
from parts.partition.interop.convert import install_apply, remove_apply
from parts.partition.interop.sharded_state import adopt_edits
from parts.partition.interop.zero_grad import install_zero_grad, remove_zero_grad
from parts.partition.coordinator.attached import Attached, Through
from parts.partition.coordinator.backward import BackwardLifecycle
from parts.partition.coordinator.checks import agree_to_attach, agreement_scopes, external_of
from parts.partition.coordinator.hooks import AttachedLookup, ModuleHooks, eager, register_pre_backward
from parts.partition.coordinator.plan import Knobs
from parts.partition.coordinator.returned import backward_outputs, returned_params
from parts.partition.coordinator.stats import CoordinatorStats
from parts.partition.coordinator.step import ModuleCall, StepState
from parts.partition.coordinator.trace import FORWARD, phase_name
from parts.partition.coordinator.transforms import check_transform_params
from parts.partition.coordinator.uneven import conditional_roots
from parts.partition.core import exact, points
from parts.partition.core.grads import grad_dtype
from parts.partition.core.param import meta
from parts.partition.core.precision import MixedPrecision, apply_mixed_precision
from parts.partition.core.compression import Compression, apply_compression, check_compression

_attached = AttachedLookup()
"""Which coordinator hooks a module: a weak lookup for the module-level ``detach(module)`` and
``register_external_parameter(module, p)``; it configures nothing and forgets dead modules."""


class FetchCoordinator(BackwardLifecycle):
    """Fetches and releases sharded parameters around every fetch unit; see ``attach``.

    The hooks and the step lifecycle live here; the state in the pieces ``attach`` builds
    (attached.py; docs/architecture.md). The element-count knobs are ``plan.Knobs``.
    ``mixed_precision``: a ``MixedPrecision`` policy (fp32 shards gathered as ``param_dtype``,
    grads reduce-scattered in ``reduce_dtype``; core/precision.py).
    ``sync_buffers`` (default True, DDP's ``broadcast_buffers``): rank 0's buffers are broadcast
    at the start of every step in train mode and of the first other step after one
    (``interop/buffers.py``), so BatchNorm statistics and evaluation agree on every rank.
    ``secondary_group`` (a process group of this node's ranks): backward gathers over it alone,
    from secondary shards kept after forward (ZeRO++ hpZ; secondary.py).
    ``conditional``: submodules (or classes) that ranks run or skip on their own (MoE experts, branches),
    gathered with the module around them, their grads reduced at the end of backward (uneven.py).
    ``reproducible``: grads summed in fixed point (``plan.Knobs``; docs/reproducibility.md).
    """

    group, secondary_group = WeakGroup(), WeakGroup()  # not kept alive past destroy_process_group (see WeakGroup)
    (table, live, prefetcher, reducer, check, counters, steps, flat_grads, flat_ids, frozen, watch, uneven,
     _undo_precision, _checker, _hooks, _grad_hooks, _unhooked, _stack, _bwd_phase, _bwd_creates_graph,
     _units, _running, trainable) = (Through() for _ in range(23))  # the attached state (attached.py), read through

    def __init__(self, group: GroupArg = None, *, prefetch_bucket_size: int = 5_000_000,
                 max_reuse_distance: int = 5_000_000, max_live_parameters: int = 1_000_000_000,
                 persistence_threshold: int = 100_000, model_persistence_threshold: int = sys.maxsize,
                 overlap_comm: bool = True, debug: bool = False,
                 reduce_bucket_size: int = 5_000_000, cache_freed_storage: bool = True,
                 mixed_precision: Optional[MixedPrecision] = None,
                 sync_buffers: bool = True, fetch_unit_size: int = 5_000_000,
                 secondary_group: GroupArg = None, compression: Optional[Compression] = None,
                 conditional: Sequence = (), reproducible: bool = False) -> None:
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError(f"FetchCoordinator: mixed_precision takes a parts.partition.MixedPrecision, "
                            f"got {type(mixed_precision).__name__}")
        self.group, self.mixed_precision, self.sync_buffers = group, mixed_precision, sync_buffers
        self.secondary_group, self.conditional = secondary_group, tuple(conditional)
        self.compression = check_compression(compression)  # codes on the wire (core/compression.py)
        self.knobs = Knobs(prefetch_bucket_size, max_reuse_distance, max_live_parameters,
                           persistence_threshold, model_persistence_threshold, overlap_comm, debug,
                           reduce_bucket_size, cache_freed_storage, fetch_unit_size, reproducible)
        if reproducible and self.compression is not None:
            raise ValueError("FetchCoordinator: reproducible=True sums grads in fixed point, the same bits "
                             "in any order; compression=Compression(...) rounds them by codes that depend "
                             "on which ranks meet, so the two cannot be combined: pass compression=None")
        self._state: Optional[Attached] = None  # while attached
        self._last: Optional[CoordinatorStats] = None  # the stats of a detached coordinator's last step
        self._no_sync = 0  # depth of no_sync() contexts entered

    @property
    def _root(self) -> Optional[nn.Module]:
        """The module this coordinator is attached to (None while detached)."""
        return self._state.root if self._state is not None else None

    def attach(self, module: nn.Module) -> "FetchCoordinator":
        """Install the hooks on ``module`` (sharded by ``partitioned``/``partition_module``)."""
        if self._root is not None:
            raise RuntimeError("FetchCoordinator.attach: this coordinator is already attached to a "
                               "module; call detach() first or make a new coordinator")
        agree_to_attach(module, self, _attached)  # local checks and settings, agreed by every rank
        precision = apply_mixed_precision(module, self.mixed_precision) if self.mixed_precision else None
        undo = apply_compression(module, self.compression, precision)  # compute dtypes, codecs on the records
        drop_aborted = weak_method(self._drop_aborted_backward)
        self._state = Attached(module, self.knobs, self.group, self.mixed_precision, self.sync_buffers,
                               undo, weak_method(self._backward_step), drop_aborted, self.secondary_group,
                               agreement_scopes(module, self.group), conditional_roots(module, self.conditional))
        for index in range(len(self.table.modules)):
            if index == 0 or self.table.sets[index]:
                self._hook(index)
        self._follow_requires_grad()
        for sub in self.table.modules:
            _attached[sub] = self
        for m in self.table.records.values():
            m.attached = True
        if self.knobs.debug:
            self._checker = weakref.WeakMethod(self.steps.outside)
            points.register(self._records(), self._checker)
        if self.knobs.reproducible:
            self._exact(True)
        install_zero_grad(self.table.modules, drop_aborted)
        install_apply(self.table.modules)
        for sub in self.table.modules:  # fetched by the hooks: the construction-time check is not needed
            drop_forward_check(sub)
        return self

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Hybrid layouts: the backwards of steps begun inside (DDP's ``no_sync``) leave their
        cross-replica mean to the next backward outside (or the optimizer step): under gradient
        accumulation it crosses once per step. Reduce-scatters within the shard group run as always."""
        self._no_sync += 1
        try:
            yield
        finally:
            self._no_sync -= 1

    def _exact(self, on: bool) -> None:
        """Reproducible mode on (or off) for every parameter: fixed-point grad sums, per parameter
        (the flat persistent reduce-scatter is left out: its grads go the per-parameter way)."""
        records = list(self.table.records.values())
        self.reducer.exact = on
        if not on:
            exact.disable(records)
            return
        self.reducer.flat = None
        reduce_dtype = self.mixed_precision.reduce_dtype if self.mixed_precision else torch.float32
        exact.enable(records, lambda m: grad_dtype(m.dtype, reduce_dtype))

    def _records(self) -> list:
        return [meta(p) for p in self.table.params.values()]

    def detach(self) -> None:
        """Remove every hook; parameters stay sharded (use ``gathered`` to read them). In-place edits of
        kept-gathered copies (peft's ``merge_and_unload``) are written into the shards first."""
        if self._root is None:
            return
        if self._stack:
            raise RuntimeError("FetchCoordinator.detach: called inside a forward (modules "
                               f"{[self.table.names[c.index] for c in self._stack]} are running)")
        self._drop_aborted_backward()
        self.reducer.wait()
        adopt_edits((self.table.param_names.get(i, f"#{i}"), p) for i, p in self.table.params.items())
        if self.knobs.debug:
            self.steps.outside("detach")
            points.unregister(self._records(), self._checker)
        self.steps.close()
        self.watch.close()
        for handle in [*self._hooks.values(), *self._grad_hooks]:
            handle.remove()
        self.live.release_all()
        if self._undo_precision is not None:
            self._undo_precision()
        remove_zero_grad(self.table.modules)
        if self.knobs.reproducible:
            self._exact(False)
        for m in self.table.records.values():
            m.attached = False
        remove_apply(self.table.modules)
        for sub in self.table.modules:
            restore_forward_check(sub)
            if _attached.get(sub) is self:
                del _attached[sub]
        self._last, self._state = self.steps.last, None

    def _hook(self, index: int) -> None:
        """Hook the module at ``index``: a unit root fetches (lightly if it holds flat persistent
        params only), a module with parameters others may read is watched; again after its set grew."""
        hooks = self._hooks.get(index)
        light = index != 0 and self._all_flat(self.table.sets[index])
        if hooks is not None and hooks.handles and (hooks.light == light or not hooks.light):
            return
        if hooks is not None:
            hooks.remove()
        sub = self.table.modules[index]
        hooks = self._hooks[index] = ModuleHooks(sub, light=light)
        if self.table.is_unit_root(index):  # a module inside a unit has no forward hooks (its unit fetches)
            pre, post = (self._pre_forward_light, self._post_forward_light) if light else \
                (self._pre_forward, self._post_forward)
            hooks.install(partial(pre, index), partial(post, index))
        own = [meta(p).id for p in sub.parameters(recurse=False)]
        if own and not self._all_flat(own):  # flat persistent params are gathered whoever reads them
            unit = self.table.unit[index]
            hooks.watch(unit, self._on_param_read, self._running.flag(unit))

    def _all_flat(self, ids: list) -> bool:
        """True if every id is a flat persistent parameter (gathered for the whole step: flat.py)."""
        flat = self.flat_ids
        return all(pid in flat for pid in ids)

    def register_external_parameter(self, module: nn.Module, param: nn.Parameter) -> None:
        """Gather ``param`` (owned by another module) whenever ``module`` runs, forward and backward."""
        if self._root is None:
            raise RuntimeError("register_external_parameter: attach the coordinator first")
        self._add_external(*external_of(self.table, module, param))

    def _add_external(self, index: int, pid: int) -> None:
        index = self._units.get(index, index)
        index = self.table.unit[index] if index not in self._units.values() else index
        if self.table.add_external(index, pid):
            self._hook(index)

    @eager
    def _on_param_read(self, owner: int, param: nn.Parameter) -> None:
        """A module read a parameter of ``owner``; inside another module's forward, fetch it."""
        if not self._stack or self._root is None:
            return
        call = self._stack[-1]
        pid = self.table.pid(param)
        if call.index == owner or pid is None or pid in call.ids:
            return
        self._take_external(call, pid)

    def _take_external(self, call: ModuleCall, pid: int) -> None:
        """``call``'s module uses ``pid`` of another: fetch it now and in every later call."""
        self._add_external(call.index, pid)
        call.ids.append(pid)
        self.check.point(self.steps.get(call.phase), "external", call.index, [pid])
        self.live.gather([pid], async_op=False)
        self.live.use([pid])

    def _fetch(self, call: ModuleCall, kind: str) -> None:
        """Gather what ``call`` needs (releasing idle params to fit the budget), then prefetch."""
        step = self.steps.current[call.phase]
        self.prefetcher.observe(step, kind, call.index)
        self.check.point(step, kind, call.index)
        self.live.make_room(set(call.ids), step)
        self.prefetcher.count_fetch(call.ids)
        self.live.gather(call.ids, async_op=False, kind=kind)
        self.live.use(set(call.ids))
        self.prefetcher.prefetch(step)

    def _phase_of(self, module: nn.Module) -> str:
        if self._stack:
            return self._stack[0].phase
        self._drop_aborted_backward()
        if in_backward() and self._bwd_phase is not None:
            return self._bwd_phase
        phase = phase_name(module.training, torch.is_grad_enabled())
        if not self.steps.active(phase):
            self.steps.begin(phase)
            self.steps.current[phase].no_sync = self._no_sync > 0
        if not in_backward():
            self.live.forwards += 1
        return phase

    def stats(self) -> Optional[CoordinatorStats]:
        """Counters of the last finished step (None before the first one ends)."""
        last = self.steps.last if self._root is not None else None
        return last if last is not None else self._last

    @eager
    def _pre_forward(self, index: int, module: nn.Module, args: tuple) -> None:
        if self._root is None:
            return
        if functorch_active():
            check_transform_params(module)
        phase = self._phase_of(module)
        call = ModuleCall(index, phase, list(self.table.sets[index]))
        self._stack.append(call)
        self._running.mark(index)
        self._fetch(call, FORWARD)

    @eager
    def _pre_forward_light(self, index: int, module: nn.Module, args: tuple) -> None:
        """A unit of flat persistent params only: within a step nothing to fetch (they are gathered
        from its start to its end) nor to trace; called outside any forward, a call of its own."""
        if not self._stack:
            self._pre_forward(index, module, args)

    @eager
    def _post_forward_light(self, index: int, module: nn.Module, args: tuple, output: Any) -> None:
        if self._stack and self._stack[-1].index == index:
            self._post_forward(index, module, args, output)

    @eager
    def _post_forward(self, index: int, module: nn.Module, args: tuple, output: Any) -> None:
        if self._root is None or not self._stack:
            return
        call = self._pop(index)
        if call is None:
            return
        if self._stack and output is not None and not in_backward():
            self._lend_returned(output)
        step = self.steps.get(call.phase)
        self.live.done_with(call.ids, step)
        if step is None or self._stack or in_backward():
            # in backward (a recompute): the hooks serve a reentrant checkpoint's inner backward
            if step is not None and output is not None and torch.is_grad_enabled():
                self._hook_backward(call, step, output, None if in_backward() else args)
            return
        if sys.exc_info()[0] is not None:  # the forward raised: no collective on the way out
            self.steps.abandon(call.phase)
            return
        if output is not None and torch.is_grad_enabled():
            self._hook_backward(call, step, output, args)
        if not step.pending_backward:
            self.steps.end(call.phase)
            self.uneven.after_forward()

    def _hook_backward(self, call: ModuleCall, step: StepState, output: Any, args: Any = None) -> None:
        fire = partial(self._pre_backward, call.index, call.phase)
        if args is not None:  # frozen params released once the unit's backward is over (frozen.py)
            fire = self.frozen.wrap(call.ids, args, fire)
        step.pending_backward |= register_pre_backward(backward_outputs(self.table, output), fire)

    def _lend_returned(self, output: Any) -> None:
        """Parameters the module returned as they are are the caller's to use (returned.py)."""
        caller = self._stack[-1]
        for pid in returned_params(self.table, output):
            if pid not in caller.ids and pid not in self.flat_ids:
                self._take_external(caller, pid)

    def _pop(self, index: int) -> Optional[ModuleCall]:
        for k in range(len(self._stack) - 1, -1, -1):
            if self._stack[k].index == index:
                call = self._stack.pop(k)
                for dropped in self._stack[k:]:  # aborted inner calls (e.g. checkpoint early stop)
                    self.live.done_with(dropped.ids, self.steps.get(dropped.phase))
                del self._stack[k:]
                self._running.mark(self._stack[-1].index if self._stack else None)
                return call
        return None


def attached_to(module: nn.Module) -> Optional[FetchCoordinator]:
    """The coordinator whose hooks are on ``module`` (None if none)."""
    return _attached.get(module)
