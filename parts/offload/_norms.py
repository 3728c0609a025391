"""The norms a step during backward keeps of each grad it consumes (``OffloadedOptimizer.step_in_backward``):
a global grad norm after that backward counts grads that no longer exist through them."""

from __future__ import annotations

import math
from typing import Sequence

import torch

NORM_TYPES = (2.0,)
"""The norm orders recorded for each grad a step during backward consumes, unless
``step_in_backward(norm_types=...)`` asks for more: the one ``clip_grad_norm_`` takes by default
(each order is a pass over the grad; the finite check uses it too)."""


def grad_norms(grad: torch.Tensor, orders: tuple[float, ...] = NORM_TYPES) -> dict[float, torch.Tensor]:
    """The norms of ``grad`` of ``orders`` a global grad norm adds up (fp32, as ``parts.comm.norm``
    computes them)."""
    g = grad.detach().float().reshape(-1)
    norms = {n: torch.linalg.vector_norm(g, n) for n in orders if not math.isinf(n)}
    if math.inf in orders:
        # max |g| from one min/max pass: the same bits as vector_norm(g, inf), whose CPU kernel
        # takes ~20x longer
        low, high = torch.aminmax(g) if g.numel() else (g.new_zeros(()), g.new_zeros(()))
        norms[math.inf] = torch.maximum(high.abs(), low.abs())
    return norms


def norm_orders(norm_types: Sequence[float]) -> tuple[float, ...]:
    """``norm_types`` with order 2 (the finite check's) as sorted floats; a clear error for a bad order."""
    orders = {2.0}
    for n in norm_types:
        if isinstance(n, bool) or not isinstance(n, (int, float)) or not (n > 0):
            raise ValueError(f"OffloadedOptimizer.step_in_backward: norm_types must be positive "
                             f"orders (floats, math.inf included), got {n!r}")
        orders.add(float(n))
    return tuple(sorted(orders))
