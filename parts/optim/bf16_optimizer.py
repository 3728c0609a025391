"""BF16Optimizer: flat buffers, fp32 master partitions, any wrapped torch optimizer."""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch

from parts.base.weak import weak_method
from parts.base.wrapper import OptimizerWrapper
from parts.comm import GroupArg, ProcessGroup, WeakGroup, comm_device, resolve_group
from parts.comm.norm import local_norms, local_sum
from parts.partition.core.param import is_partitioned, meta
from parts.partition.core.points import announce
from parts.partition.core.replicas import pending_records, sync_replica_grads

from . import _collectives as C
from . import offloaded
from . import state_dict as ckpt
from .flat_group import FlatGroup
from .layout import STEP_CHUNK, counted_ranges, plan_buckets
from .loss_scaler import DynamicLossScaler
from .reader import Source
from .sharded import ShardedParam
from .validation import ParamChecker, check_options, check_param_dtype, check_shard_group

logger = logging.getLogger("parts.optim")

NamedParams = Union[Iterable[tuple[str, torch.Tensor]], dict]


class BF16Optimizer(OptimizerWrapper):
    """Mixed-precision ZeRO-1 wrapper: the wrapped optimizer steps fp32 master partitions.

    Grads live in the fp32 buffers the post-accumulate-grad hooks fill, not in ``p.grad``:
    clear them with this wrapper's ``zero_grad()`` (``model.zero_grad()`` does not reach them).
    Extra keywords: ``loss_scaler`` (fp16; created by default for fp16 params),
    ``named_parameters`` (e.g. ``model.named_parameters()``: names used in checkpoints and
    errors), ``step_chunk`` (elements per master view the wrapped optimizer steps; see
    layout.STEP_CHUNK), ``allow_fp32`` (accept fp32 params, which are otherwise a TypeError) and
    ``param_dtype`` (e.g. torch.bfloat16: take fp32 params, keep their full-precision values
    as the masters and cast the params themselves, so the masters do not start from rounded
    weights: build the model in fp32 and let the optimizer cast it; replicated params only).

    Grid-wide norm (e.g. dp x tensor parallel): ``norm_groups`` are further process groups the
    partial norm is summed over after ``group`` (a tp group); ``replicated(p) -> bool`` marks
    params whose grad is the same on every rank of ``norm_groups`` (not tp-split): only the rank
    that is rank 0 of every norm group counts those, so each element counts once. The clip,
    the skip on a non-finite norm and ``last_grad_norm`` then use that grid-wide norm.

    Every step takes the global norm, clipping or not: it is also the check that every rank's
    grads are finite (a step is skipped on every rank or none), at the cost of one
    ``_foreach_norm``, one all-reduce on the communication device and one host read.
    """

    process_group = WeakGroup()  # not kept alive past destroy_process_group (see WeakGroup)

    def __init__(self, optimizer: torch.optim.Optimizer, *, group: GroupArg = None,
                 clip_grad: float = 0.0, norm_type: float = 2.0,
                 allgather_bucket_size: int = 500_000_000,
                 grad_accum_dtype: torch.dtype = torch.float32,
                 loss_scaler: Optional[DynamicLossScaler] = None,
                 named_parameters: Optional[NamedParams] = None,
                 step_chunk: int = STEP_CHUNK, allow_fp32: bool = False,
                 norm_groups: Sequence[ProcessGroup] = (),
                 replicated: Optional[Callable[[torch.Tensor], bool]] = None,
                 param_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(optimizer)
        norm_groups = tuple(norm_groups)  # kept as GroupInfos (weak): see norm_groups
        check_options(clip_grad=clip_grad, norm_type=norm_type, step_chunk=step_chunk,
                      allgather_bucket_size=allgather_bucket_size,
                      grad_accum_dtype=grad_accum_dtype, norm_groups=norm_groups,
                      replicated=replicated)
        self.step_chunk, self.allow_fp32 = int(step_chunk), bool(allow_fp32)
        self.param_dtype = check_param_dtype(param_dtype)
        self.process_group = group
        self.clip_grad, self.norm_type = float(clip_grad), float(norm_type)
        self.grad_accum_dtype = grad_accum_dtype
        self.comm = resolve_group(group, "BF16Optimizer(group=...)", group_needs_init=False)
        self.world_size, self.rank = self.comm.world_size, self.comm.rank
        plan_buckets([], allgather_bucket_size, self.world_size)  # validate before touching params
        self._counts_replicated = self._norm_group_ranks_are_zero(norm_groups)
        self._replicated, self.skipped_steps = replicated, 0
        self.last_grad_norm: Optional[float] = None
        self._has_grads = False
        self.flat_groups: list[Optional[FlatGroup]] = []
        self.sharded_groups: list[list[ShardedParam]] = []
        self._where: dict[int, tuple[str, int, int]] = {}
        self._norm_ranges: list[list[tuple[int, int]]] = []
        self._norm_sharded: list[list[bool]] = []
        self._hooks: list[Any] = []
        self._build(self._names(named_parameters))
        C.reproducible(self.sharded_groups, self.flat_groups)  # refuses float-averaged params beside it
        offloaded.setup(self)  # shards on disk: masters there too (needs OffloadedOptimizer inside)
        self.loss_scaler = loss_scaler
        if loss_scaler is None and self._model_dtype() == torch.float16:
            self.loss_scaler = DynamicLossScaler()
        parts = [fg.master.numel() for fg in self.flat_groups if fg is not None]
        self._buckets = plan_buckets(parts, allgather_bucket_size, self.world_size)
        self._patch_step_function()

    # -- construction -----------------------------------------------------------------------
    def _names(self, named: Optional[NamedParams]) -> dict[int, str]:
        items = named.items() if isinstance(named, dict) else (named or [])
        return {id(p): n for n, p in items}

    def _build(self, names: dict[int, str]) -> None:
        checker = ParamChecker(self.allow_fp32 or self.param_dtype is not None)
        for g, group in enumerate(self.optimizer.param_groups):
            replicated, rep_names, sharded = [], [], []
            for i, p in enumerate(group["params"]):
                name = names.get(id(p), f"group{g}.param{i}")
                if is_partitioned(p):
                    record = meta(p)
                    check_shard_group(record.name or name, record.info.global_ranks(),
                                      self.comm.global_ranks(),
                                      self.process_group is None)
                    checker.check(p, name, record.shard.dtype)
                    self._check_sharded_cast(name, record.shard.dtype)
                    sp = ShardedParam(p, record, self.rank)
                    sp.name = sp.name or name
                    self._where[id(p)] = ("sharded", g, len(sharded))
                    sharded.append(sp)
                else:
                    checker.check(p, name, p.dtype)
                    self._where[id(p)] = ("flat", g, len(replicated))
                    replicated.append(p)
                    rep_names.append(name)
            self._add_group(group, replicated, rep_names, sharded)

    def _check_sharded_cast(self, name: str, dtype: torch.dtype) -> None:
        """``param_dtype`` casts replicated params only: a sharded fp32 param has a better path."""
        if self.param_dtype is not None and dtype != self.param_dtype:
            raise TypeError(f"BF16Optimizer(param_dtype={self.param_dtype}): parameter {name!r} is "
                            f"sharded with {dtype} shards; for ZeRO-3 in mixed precision attach the "
                            f"model with mixed_precision=parts.partition.MixedPrecision() and step "
                            f"shards(model) with the plain optimizer (fp32 shards are the masters)")

    def _add_group(self, group: dict, replicated: list, rep_names: list[str],
                   sharded: list[ShardedParam]) -> None:
        """Pack one group's replicated params, hook their grads, point the group at the masters."""
        fg = None
        if replicated:
            fg = FlatGroup(replicated, rep_names, self.world_size, self.rank,
                           self.grad_accum_dtype, self.step_chunk, self.param_dtype)
            for i, p in enumerate(replicated):
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    fg.make_hook(i, weak_method(self._mark_grads))))  # no cycle through C++
        self.flat_groups.append(fg)
        self.sharded_groups.append(sharded)
        self._norm_ranges.append(self._flat_norm_ranges(fg))
        self._norm_sharded.append([self._counts(s.param) for s in sharded])
        group["params"] = (fg.master_chunks if fg else []) + [s.master for s in sharded]
        self._adopt_state(fg, sharded)

    # -- which grads count toward the norm on this rank --------------------------------------
    @property
    def norm_groups(self) -> tuple[ProcessGroup, ...]:
        """The further process groups the grad norm is summed over (see the class docstring)."""
        return tuple(info.group for info in self._norm_infos)

    def _norm_group_ranks_are_zero(self, norm_groups: tuple) -> bool:
        """True if this rank is rank 0 of every norm group (it counts replicated params)."""
        self._norm_infos = C.norm_group_infos(norm_groups)
        return all(info.rank == 0 for info in self._norm_infos)

    def _counts(self, p: torch.Tensor) -> bool:
        """Whether this rank counts ``p``'s grad in the norm."""
        return self._counts_replicated or self._replicated is None or not self._replicated(p)

    def _flat_norm_ranges(self, fg: Optional[FlatGroup]) -> list[tuple[int, int]]:
        """``(offset, length)`` runs of this rank's grad partition that count toward the norm."""
        if fg is None:
            return []
        counted = [self._counts(p) for p in fg.params]
        if all(counted):
            return [(0, fg.real_numel())]
        return counted_ranges(fg.layout.pieces(self.rank), counted)

    def _adopt_state(self, fg: Optional[FlatGroup], sharded: list[ShardedParam]) -> None:
        """Move state the wrapped optimizer already holds (e.g. Adagrad's) onto the masters."""
        state = self.optimizer.state
        if fg is not None and any(p in state for p in fg.params):
            ckpt.adopt_flat_state(self.optimizer, fg, [state.pop(p, {}) for p in fg.params])
        for s in sharded:
            if s.param in state:
                ckpt.adopt_sharded_state(self.optimizer, s, state.pop(s.param))

    def _model_dtype(self) -> Optional[torch.dtype]:
        for fg in self.flat_groups:
            if fg is not None:
                return fg.flat.dtype
        for sharded in self.sharded_groups:
            for s in sharded:
                return s.record.shard.dtype
        return None

    def _mark_grads(self) -> None:
        self._has_grads = True

    # -- training ---------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (unchanged without a loss scaler)."""
        return loss if self.loss_scaler is None else loss * self.loss_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the fp32 grad buffers (and drop any model-dtype grads and grad shards)."""
        for fg in self.flat_groups:
            if fg is not None:
                fg.grad.zero_()
                if fg.part_grad is not fg.grad:
                    fg.part_grad.zero_()
                for p in fg.params:
                    p.grad = None
        for sharded in self.sharded_groups:
            for s in sharded:
                s.zero_grad(set_to_none)
        self._has_grads = False

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """Reduce-scatter, global norm, skip or clip, inner step, write back, all-gather."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        announce([s.param for sh in self.sharded_groups for s in sh], "BF16Optimizer.step")
        sync_replica_grads(pending_records(s.param for sh in self.sharded_groups for s in sh))
        if not self._has_grads and not self._sharded_have_grads():
            raise RuntimeError("BF16Optimizer.step() was called before any backward produced "
                               "gradients (or right after zero_grad()); call loss.backward() first")
        self.sync_masters()
        self._reduce_grads()
        grads = self._local_grads()
        scale = 1.0 if self.loss_scaler is None else self.loss_scaler.scale
        norm = self._host_norm(self._global_norm(self._norm_grads(grads)).item(), scale)
        self.last_grad_norm = float(norm)
        finite = math.isfinite(self.last_grad_norm)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=not finite)
        if not finite:
            self._skip(scale)
            return loss
        self._scale_grads(grads, norm, scale)
        self.optimizer.step()
        self.write_back()
        return loss

    def _sharded_have_grads(self) -> bool:
        return any(s.has_grad() for sh in self.sharded_groups for s in sh)

    def _reduce_grads(self) -> None:
        for fg in self.flat_groups:
            if fg is not None:
                C.reduce_scatter_mean(fg.part_grad, fg.grad, self.comm)
        for sharded in self.sharded_groups:
            for s in sharded:
                s.master.grad = s.grad()

    def _local_grads(self) -> list[torch.Tensor]:
        """This rank's real (unpadded) grad elements: partitions and grad shards."""
        out = [fg.part_grad.narrow(0, 0, fg.real_numel()) for fg in self.flat_groups if fg]
        for sharded in self.sharded_groups:
            out += [s.master.grad.narrow(0, 0, s.real_numel()) if s.master.grad is not None
                    else offloaded.lazy_grad(s) for s in sharded
                    if s.master.grad is not None or (s.offloaded and s.has_grad())]
        return out

    def _norm_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parts of ``grads`` (as ``_local_grads`` lists them) this rank counts in the norm."""
        if self._counts_replicated or self._replicated is None:
            return grads
        out = [fg.part_grad.narrow(0, lo, n) for fg, ranges in zip(self.flat_groups, self._norm_ranges)
               for lo, n in ranges]
        for sharded, counted in zip(self.sharded_groups, self._norm_sharded):
            out += [s.master.grad.narrow(0, 0, s.real_numel()) if s.master.grad is not None
                    else offloaded.lazy_grad(s) for s, c in zip(sharded, counted)
                    if c and (s.master.grad is not None or (s.offloaded and s.has_grad()))]
        return out

    def _global_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The global norm on the communication device: one ``_foreach_norm``, one all-reduce; in
        fixed point for a model in reproducible mode (the same bits at any world size)."""
        p = self.norm_type
        exact = C.reproducible_norm(grads, self.sharded_groups, self.flat_groups, self.comm,
                                    self._norm_infos) if p == 2.0 else None
        if exact is not None:
            return exact
        norms = local_norms(grads, p, dtype=None)  # stored grads (callables) read one at a time
        return C.all_reduce_norm(local_sum(norms, comm_device(self.comm), p), p, self.comm, self._norm_infos)

    @staticmethod
    def _host_norm(value: float, scale: float) -> torch.Tensor:
        """The norm read to the host (fp32 on the CPU), unscaled by the loss scale."""
        norm = torch.tensor(value, dtype=torch.float32, device="cpu")
        return norm / scale if scale != 1.0 else norm

    def _scale_grads(self, grads: list[torch.Tensor], norm: torch.Tensor, scale: float) -> None:
        """Clip (and unscale) by one host-computed fp32 coefficient; nothing to do at 1."""
        coef = torch.ones((), dtype=torch.float32, device="cpu")
        if self.clip_grad > 0:
            coef = torch.clamp(self.clip_grad / (norm + 1e-6), max=1.0)
        if scale != 1.0:
            coef = coef / scale
        grads = offloaded.set_grad_scale(self, grads, coef)
        if float(coef) != 1.0:
            for g in grads:
                g.mul_(coef.to(g.device))

    def _skip(self, scale: float) -> None:
        self.skipped_steps += 1
        where = "loss scale overflow" if self.loss_scaler is not None else "non-finite grad norm"
        logger.warning("BF16Optimizer rank %d: %s (norm=%s, scale=%s): step skipped "
                       "(%d skipped so far)", self.rank, where, self.last_grad_norm, scale,
                       self.skipped_steps)

    def write_back(self) -> None:
        """Copy the fp32 masters into the model-dtype params: every rank's partitions are
        all-gathered into the flat buffers, sharded params' shards are written in place."""
        masters, flats = [], []
        for fg in self.flat_groups:
            if fg is not None:
                fg.zero_padding()
                masters.append(fg.master)
                flats.append(fg.flat)
        C.gather_buckets(self._buckets, masters, flats, self.comm)
        for fg in self.flat_groups:
            if fg is not None:
                fg.mark_written()
        for sharded in self.sharded_groups:
            for s in sharded:
                if not s.offloaded:  # offloaded masters were written back chunk by chunk in the step
                    s.write_back()

    def sync_masters(self) -> list[str]:
        """Re-read the fp32 masters of params written since the last step (names returned).

        Called by ``step()`` and the checkpoint methods: weights loaded after the optimizer was
        built (``load_full_state_dict``, ``model.load_state_dict``, ``nn.init``) win over the
        cached masters. Writes through ``p.data`` of a replicated param bypass the version counters
        this relies on and are not seen: write through the param itself under ``torch.no_grad()``."""
        names = []
        for fg in self.flat_groups:
            if fg is not None:
                names += fg.refresh_master()
        names += [s.name for sh in self.sharded_groups for s in sh if s.refresh_master()]
        if names:
            logger.info("BF16Optimizer rank %d: params written since the last step, fp32 masters "
                        "re-read: %s", self.rank, names)
        return names

    # -- accessors --------------------------------------------------------------------------
    def locate(self, p: torch.Tensor) -> tuple[str, int, int]:
        """Where ``p`` lives: ``("flat", group, index)`` or ``("sharded", group, index)``."""
        where = self._where.get(id(p))
        if where is None:
            raise KeyError(f"parameter of shape {tuple(p.shape)} is not managed by this BF16Optimizer")
        return where

    def full_fp32_param(self, p: torch.Tensor) -> torch.Tensor:
        """The full fp32 master of ``p``, gathered across ranks (a collective: call on every rank)."""
        return ckpt.full_param_tensor(self, p, None)

    def full_state(self, p: torch.Tensor, key: str) -> ckpt.StateValue:
        """The full optimizer state ``key`` of ``p`` gathered across ranks (collective)."""
        return ckpt.full_param_tensor(self, p, key)

    def full_grad(self, p: torch.Tensor) -> torch.Tensor:
        """The full grad of ``p`` averaged across ranks, as ``step()`` will see it before clipping."""
        return ckpt.full_grad_tensor(self, p)

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """This rank's part: options, fp32 master, per-element state, layout and param metadata."""
        return ckpt.rank_state_dict(self)

    def sharded_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """Views for ``torch.distributed.checkpoint`` keyed by ``model``'s FQNs (parts.optim.dcp_state)."""
        from . import dcp_state  # on first use: torch.distributed.checkpoint takes seconds to import
        return dcp_state.sharded_state_dict(self, model)

    def load_sharded_state_dict(self, model: torch.nn.Module, state: dict[str, Any]) -> None:
        """Install what ``dcp.load`` filled into ``sharded_state_dict(model)``, at any world size."""
        from . import dcp_state
        dcp_state.load_sharded_state_dict(self, model, state)

    def consolidated_state_dict(self) -> Optional[dict[str, Any]]:
        """World-size-free full state on rank 0 (None elsewhere); a collective."""
        return ckpt.consolidated_state_dict(self)

    def load_state_dict(self, state_dict: Optional[Source], strict: bool = True) -> None:  # type: ignore[override]
        """Load a consolidated dict, or the list of every saved rank's dicts, at any world size.

        Raises before changing anything if a model parameter is missing or has another shape,
        if a saved master/state tensor is not floating point (``step`` counters may be integer),
        or, with ``strict`` (the default), if the checkpoint has parameters the model lacks;
        ``strict=False`` ignores those extra parameters (missing ones still raise)."""
        ckpt.load(self, state_dict, strict)
