"""The global 2-norm in fixed point: the same bits however the elements are spread over ranks.

Reproducible mode's clipping (``parts.partition.clip_grad_norm_`` of a model attached with
``reproducible=True``). The square of an fp32 or bf16 element is exact in float64; one MAX
all-reduce gives every rank the largest square and the largest bound of the element count any
rank passed (the same at any world size), and from them one exponent at which every square
becomes two int64 words (``parts.base.fixed_point.split_squares``). Integer sums are exact in
any order, so the one SUM all-reduce of the two words, and the square root taken from them in
float64, give the same norm at every world size. Over a grid each all-reduce runs over the
rank's group and then over each of ``extra`` in turn (a dp group, then a tp group). A non-finite
element makes the norm nan (or inf if none is nan).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Sequence, Union

import torch

from parts.base.fixed_point import join_squares, largest, split_squares, square_exponents
from parts.comm.collectives import ReduceOp, all_reduce
from parts.comm.device import comm_device
from parts.comm.group import GroupInfo

Grad = Union[torch.Tensor, Callable[[], torch.Tensor]]
CHUNK = 1 << 18
"""Elements squared together: small grads concatenated, large ones in pieces, so each piece's
float64 intermediates stay in cache and few kernels run."""


def _plain(t: torch.Tensor) -> torch.Tensor:
    return (t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t).reshape(-1)


def _chunks(held: list[torch.Tensor]) -> Iterable[torch.Tensor]:
    """``held`` in pieces of at most ``CHUNK`` elements: runs of small grads concatenated, large ones split."""
    run: list[torch.Tensor] = []
    size = 0
    for t in held:
        if run and (size + t.numel() > CHUNK or t.device != run[0].device):
            yield torch.cat(run) if len(run) > 1 else run[0]
            run, size = [], 0
        if t.numel() > CHUNK:
            yield from t.split(CHUNK)
            continue
        run.append(t)
        size += t.numel()
    if run:
        yield torch.cat(run) if len(run) > 1 else run[0]


def _words(pieces: Iterable[torch.Tensor], e: int, e_low: int) -> torch.Tensor:
    """The two int64 words of ``split_squares`` summed over ``pieces`` (on the CPU: one copy per device)."""
    sums: dict[torch.device, torch.Tensor] = {}
    for piece in pieces:
        words = torch.stack(split_squares(piece, e, e_low))
        sums[piece.device] = sums[piece.device] + words if piece.device in sums else words
    return sum((w.cpu() for w in sums.values()), torch.zeros(2, dtype=torch.int64))


def _flags(tops: list[float]) -> tuple[float, float]:
    """``(largest finite square, 2.0 if a nan / 1.0 if an inf / 0.0)`` from the largest magnitudes."""
    bad = 2.0 if any(t != t for t in tops) else 1.0 if any(math.isinf(t) for t in tops) else 0.0
    finite = [t for t in tops if math.isfinite(t)]
    return (max(finite) ** 2 if finite else 0.0), bad


def _reduce(value: torch.Tensor, groups: Sequence[GroupInfo], op: ReduceOp) -> torch.Tensor:
    """``value`` all-reduced over each of ``groups`` in turn, read back to the CPU."""
    for each in groups:
        value = all_reduce(value, each, op)
    return value.cpu()


def exact_global_norm(grads: Iterable[Optional[Grad]], info: GroupInfo, count: int,
                      dtype: torch.dtype = torch.float32, extra: Sequence[GroupInfo] = ()) -> torch.Tensor:
    """The 2-norm over the counted ``grads`` of every rank of ``info`` (and of ``extra``'s groups),
    as a ``dtype`` scalar on the communication device; two all-reduces (MAX, then SUM of int64)
    per group. ``count``: a bound of the elements counted in all, whose largest over the ranks is
    the same at any world size (the model's element count). A grad given as a callable is read
    when its turn comes."""
    grads = [g for g in grads if g is not None]
    held = [t for t in (_plain(g) for g in grads if not callable(g)) if t.numel()]
    stored = [g for g in grads if callable(g)]
    device = comm_device(info)
    tops = largest(held) + [top for g in stored for top in largest([_plain(g())])]
    groups = (info, *extra)
    agreed = _reduce(torch.tensor([*_flags(tops), count], dtype=torch.float64, device=device), groups, ReduceOp.MAX)
    if agreed[1] > 0:
        return torch.tensor(float("nan") if agreed[1] > 1 else float("inf"), dtype=dtype, device=device)
    e, e_low = square_exponents(float(agreed[0]), int(agreed[2]))
    total_words = _words(_chunks(held), e, e_low) + sum((_words(_chunks([_plain(g())]), e, e_low) for g in stored),
                                                        torch.zeros(2, dtype=torch.int64))
    total_words = _reduce(total_words.to(device), groups, ReduceOp.SUM)
    total = join_squares(int(total_words[0]), int(total_words[1]), e, e_low)
    return torch.tensor(math.sqrt(total), dtype=torch.float64).to(device, dtype)
