"""The global 2-norm in fixed point: the same bits however the elements are spread over ranks.

Reproducible mode's clipping (``parts.partition.clip_grad_norm_`` of a model attached with
``reproducible=True``). The square of an fp32 or bf16 element is exact in float64; one MAX
all-reduce gives every rank the largest square, and from it and the element count (the same at
any world size) one exponent at which every square becomes two int64 words
(``parts.base.fixed_point.split_squares``). Integer sums are exact in any order, so the one SUM
all-reduce of the two words, and the square root taken from them in float64, give the same norm
at every world size. A non-finite element makes the norm nan (or inf if none is nan).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Union

import torch

from parts.base.fixed_point import join_squares, split_squares, square_exponents
from parts.comm.collectives import ReduceOp, all_reduce
from parts.comm.device import comm_device
from parts.comm.group import GroupInfo

Grad = Union[torch.Tensor, Callable[[], torch.Tensor]]


def _read(g: Grad) -> torch.Tensor:
    t = g() if callable(g) else g
    return (t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t).reshape(-1)


def _largest(grads: list[Grad]) -> tuple[float, float]:
    """``(largest finite square, 2.0 if a nan / 1.0 if an inf / 0.0)`` over ``grads``."""
    top, bad = 0.0, 0.0
    for g in grads:
        t = _read(g)
        if not t.numel():
            continue
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            bad = max(bad, 2.0 if bool(torch.isnan(t).any()) else 1.0)
            t = t[finite]
        if t.numel():
            top = max(top, float(t.abs().max().to(torch.float64)) ** 2)
    return top, bad


def exact_global_norm(grads: Iterable[Optional[Grad]], info: GroupInfo, count: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 2-norm over the counted ``grads`` of every rank of ``info``, ``count`` elements in all
    (the model's, at any world size), as a ``dtype`` scalar on the communication device; two
    all-reduces (MAX, then SUM of int64)."""
    grads = [g for g in grads if g is not None]
    device = comm_device(info)
    top, bad = _largest(grads)
    agreed = all_reduce(torch.tensor([top, bad], dtype=torch.float64, device=device), info, ReduceOp.MAX).cpu()
    if agreed[1] > 0:
        return torch.tensor(float("nan") if agreed[1] > 1 else float("inf"), dtype=dtype, device=device)
    e, e_low = square_exponents(float(agreed[0]), count)
    words = torch.zeros(2, dtype=torch.int64)
    for g in grads:
        t = _read(g)
        if t.numel():
            high, low = split_squares(t, e, e_low)
            words += torch.stack([high, low]).cpu()
    words = all_reduce(words.to(device), info).cpu()
    total = join_squares(int(words[0]), int(words[1]), e, e_low)
    return torch.tensor(math.sqrt(total), dtype=torch.float64).to(device, dtype)
