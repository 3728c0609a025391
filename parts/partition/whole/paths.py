"""Which path an optimizer over shards takes: the flat shards, or whole tensors stepped by owners.

An element-wise optimizer (each element's update depends on that element's grad and state
only) gives the same result on a flat shard as on the whole tensor: it takes the shard path,
which costs nothing beyond the reduce-scatter. torch's element-wise optimizers are listed in
``ELEMENT_WISE``. Any other optimizer is probed once, on small random tensors: two steps of
its update of one 2-D tensor against the same values split into two flat pieces, state
included. If the results differ, or it refuses the flat pieces (``torch.optim.Muon``: 2-D
only), its update needs the whole tensor (a factored second moment, a per-tensor norm or
trust ratio, an orthogonalisation) and it takes the whole-tensor path; one log line says so.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

logger = logging.getLogger("parts.partition")

SHARD, WHOLE = "shard", "whole"
PATHS = (SHARD, WHOLE)

ELEMENT_WISE = frozenset(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop",
    "SparseAdam") if hasattr(torch.optim, name))
"""torch optimizers whose update of each element needs only that element: the shard path."""

_SPLIT = 13  # a 6 x 5 tensor as flat pieces of 13 and 17 elements: neither a row boundary nor a half


def _steps(cls: type, options: dict, leaves: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> Optional[list]:
    """``leaves`` after one step per entry of ``grads`` of a fresh ``cls`` (None if it refuses them)."""
    try:
        optimizer = cls([{**options, "params": leaves}])
        for step in grads:
            for leaf, g in zip(leaves, step):
                leaf.grad = g.clone()
            optimizer.step()
    except (TypeError, ValueError, RuntimeError) as error:
        logger.debug("parts.partition: probing %s: %s", cls.__name__, error)
        return None
    return [leaf.detach().reshape(-1) for leaf in leaves]


def _probe_options(optimizer: torch.optim.Optimizer) -> dict:
    """The first group's options, a zero learning rate made 1e-2 (a zero step shows no difference)."""
    options = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    if isinstance(options.get("lr"), (int, float)) and options["lr"] == 0:
        options["lr"] = 1e-2
    return options


def needs_whole(optimizer: torch.optim.Optimizer) -> bool:
    """True if ``optimizer``'s update of a 2-D tensor differs from that of its flat pieces."""
    cls, options = type(optimizer), _probe_options(optimizer)
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float64, torch.float32):
        w = torch.randn(6, 5, generator=gen, dtype=dtype)
        grads = [torch.randn(6, 5, generator=gen, dtype=dtype) for _ in range(2)]
        whole = _steps(cls, options, [w.clone()], [[g] for g in grads])
        if whole is None:
            continue
        flat = w.reshape(-1)
        pieces = [flat[:_SPLIT].clone(), flat[_SPLIT:].clone()]
        split = _steps(cls, options, pieces, [[g.reshape(-1)[:_SPLIT], g.reshape(-1)[_SPLIT:]] for g in grads])
        if split is None:
            return True
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        return not torch.allclose(torch.cat(split), whole[0], rtol=tol, atol=tol * 1e-2)
    return True  # it steps no plain 2-D tensor: the whole path holds for any update


def choose(optimizer: torch.optim.Optimizer, path: Optional[str]) -> str:
    """``path`` if given, else the shard path for a listed element-wise optimizer, else the probe's
    answer (logged once)."""
    if path is not None:
        if path not in PATHS:
            raise ValueError(f"parts.partition.route: path must be one of {PATHS} or None, got {path!r}")
        return path
    if type(optimizer) in ELEMENT_WISE:
        return SHARD
    chosen = WHOLE if needs_whole(optimizer) else SHARD
    why = ("its update of a 2-D tensor differs from that of the same values in flat pieces" if chosen == WHOLE
           else "its update of a 2-D tensor equals that of the same values in flat pieces")
    logger.info("parts.partition: %s takes the %s path (probed: %s)", type(optimizer).__name__,
                "whole-tensor" if chosen == WHOLE else "shard", why)
    return chosen


def describe(optimizer: Any) -> str:
    """The optimizer's class name for messages."""
    return type(optimizer).__name__
