"""Measure a configuration by running it: on real ranks (``measure``) or on a fake world
with a model built on the meta device (``dry_run``), which needs neither data nor hardware.

Both run the same code: ``partitioned`` builds, ``attach`` hooks, an optimizer over
``shards`` steps, and the byte counters of ``parts.comm`` and the coordinator are read after
the last of ``steps`` steps (the first step records the trace; later ones are the steady
state). So the plan of a dry run equals what the same model sends on real ranks, byte for byte.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from parts.comm import block_layout, comm_counter, fake_world
from parts.partition import FetchCoordinator, attach, meta, partitioned, shards
from parts.partition import ParamStatus
from parts.plan.layout_bytes import Plan

StepFn = Callable[[nn.Module, torch.device], torch.Tensor]
OptimizerFn = Callable[[list], torch.optim.Optimizer]


def token_step(batch: int = 1, seq_len: int = 128) -> StepFn:
    """A step for language models: ``model(input_ids=x, labels=x)`` on ``batch x seq_len`` tokens;
    the loss is the output's ``.loss`` (Hugging Face) or the output itself."""
    def step(model: nn.Module, device: torch.device) -> torch.Tensor:
        vocab = getattr(getattr(model, "config", None), "vocab_size", 2)
        ids = torch.randint(0, vocab, (batch, seq_len), device=device)
        out = model(input_ids=ids, labels=ids)
        return out.loss if hasattr(out, "loss") else out
    return step


def adamw(params: list) -> torch.optim.Optimizer:
    """The default optimizer: ``torch.optim.AdamW`` (8 bytes of fp32 state per element)."""
    return torch.optim.AdamW(params, lr=1e-4, foreach=False)


def _unique(model: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in model.parameters()}.values())


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _memory(model: nn.Module, optimizer: torch.optim.Optimizer, grads: int) -> dict[str, int]:
    """This rank's shard, grad, optimizer-state and kept-gathered bytes."""
    params = _unique(model)
    kept = [p for p in params if meta(p).status is ParamStatus.AVAILABLE]
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]  # per-element state, not step counters
    return {"param_bytes": _nbytes(meta(p).shard for p in params), "grad_bytes": grads,
            "optimizer_bytes": _nbytes(state), "persistent_bytes": _nbytes(kept)}


def _gathered_peak(model: nn.Module, coordinator: FetchCoordinator) -> int:
    """Most non-persistent full-parameter bytes at once (elements x the widest gathered dtype)."""
    params = _unique(model)
    width = max((meta(p).compute_dtype or meta(p).dtype).itemsize for p in params)
    return coordinator.stats().live_high_water * width


def measure(model: nn.Module, coordinator: FetchCoordinator, *, step: Optional[StepFn] = None,
            steps: int = 2, optimizer: OptimizerFn = adamw, device: Optional[torch.device] = None) -> Plan:
    """Run ``steps`` training steps of an attached sharded ``model`` and return the last step's plan."""
    if steps < 2:
        raise ValueError(f"measure: steps must be >= 2 (the first records the trace), got {steps}")
    step = step or token_step()
    device = device or meta(_unique(model)[0]).device
    opt = optimizer(shards(model))
    for _ in range(steps):
        before = comm_counter.snapshot()
        step(model, device).backward()
        grads = _nbytes(meta(p).grad_shard for p in _unique(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    sent = {k: comm_counter.snapshot()[k] - before[k] for k in before}
    params = _unique(model)
    first = meta(params[0])
    replicas = first.replica.world_size if getattr(first, "replica", None) is not None else 1
    return Plan(world_size=first.world_size * replicas, params=sum(meta(p).numel for p in params),
                shard_size=first.world_size,
                **_memory(model, opt, grads), gathered_peak_bytes=_gathered_peak(model, coordinator),
                allgather_bytes=sent["allgather_bytes"], reduce_scatter_bytes=sent["reduce_scatter_bytes"],
                all_reduce_bytes=sent["all_reduce_bytes"], allgather_calls=sent["allgather_calls"],
                reduce_scatter_calls=sent["reduce_scatter_calls"])


def dry_run(build: Callable[[], nn.Module], world_size: int, *, step: Optional[StepFn] = None,
            steps: int = 2, optimizer: OptimizerFn = adamw, rank: int = 0, shard_size: Optional[int] = None,
            **attach_knobs: Any) -> Plan:
    """Build ``build()`` on the meta device as ``rank`` of a fake ``world_size``-rank world, attach it
    with ``attach_knobs``, run ``steps`` steps and return the plan: no data, no hardware.
    ``shard_size``: a hybrid layout, sharded within blocks of that many ranks, replicated across."""
    with fake_world(world_size, rank):
        groups = {}
        if shard_size is not None and shard_size != world_size:
            groups = dict(zip(("group", "replicate_group"), block_layout(shard_size)))
        with partitioned(device="meta", **groups):
            model = build()
        coordinator = attach(model, **attach_knobs)
        try:
            return measure(model, coordinator, step=step, steps=steps, optimizer=optimizer,
                           device=torch.device("meta"))
        finally:
            coordinator.detach()
