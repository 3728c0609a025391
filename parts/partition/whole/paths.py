"""Which path an optimizer over shards takes: the flat shards, whole tensors stepped by owners, or
every full tensor on every rank.

- Shard: an element-wise optimizer (each element's update depends on that element's grad and
  state only) gives the same result on a flat shard as on the whole tensor; it costs nothing
  beyond the reduce-scatter. torch's element-wise optimizers are listed in ``ELEMENT_WISE``.
- Whole: a per-tensor optimizer (a factored second moment, a per-tensor norm or trust ratio,
  an orthogonalisation) needs each tensor whole, not the others: owners step whole tensors.
- Replicated: an optimizer whose update couples tensors (a sum or norm over all parameters, a
  line search, a closure called more than once) needs all of them: every rank steps every
  full tensor. Optimizers known to be such are listed in ``COUPLED`` by class name (so that
  their package need not be imported), and per-tensor ones whose first steps look element-wise
  in ``PER_TENSOR``.

Any other optimizer is probed once (whole/probe.py); one log line names the path, why, and
what it costs. The probe is a heuristic backed by the two lists; ``route(optimizer, path)``
names a path by hand.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from parts.partition.whole.probe import ORDER, REPLICATED, SHARD, WHOLE, Verdict, probe

PATHS = ORDER

ELEMENT_WISE = frozenset(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
    if hasattr(torch.optim, name))
"""torch optimizers whose update of each element needs only that element: the shard path."""

COUPLED: dict[str, Optional[str]] = {
    # a line search or several closure calls per step
    "LBFGS": None, "SAM": None, "GSAM": None, "WSAM": None, "BSAM": None, "LookSAM": None, "FriendlySAM": None,
    "AliG": None,
    # a sum, norm or maximum over all parameters
    "Prodigy": None, "DAdaptAdam": None, "DAdaptAdaGrad": None, "DAdaptAdan": None, "DAdaptLion": None,
    "DAdaptSGD": None, "AdamS": None, "Ranger21": None, "AvaGrad": None, "PCGrad": None,
    "Lamb": "pre_norm",
}
"""Optimizers (by class name) whose update couples tensors: the replicated path; a name mapped to an
option couples them only where a param group sets that option."""

PER_TENSOR: dict[str, Optional[str]] = {
    "Shampoo": None, "ScalableShampoo": None, "SOAP": None, "Conda": None,
    "GaLore": "rank", "APOLLO": "rank", "Fira": "rank",
}
"""Optimizers (by class name) whose update needs each tensor whole, but only after a first phase that
is element-wise (preconditioning from a later step on, a projection every few steps) or only where a
param group sets an option: the whole path, without a probe the first phase could fool."""

_SECOND_ORDER = ("it estimates the Hessian by differentiating the grads again (backward(create_graph=True)), "
                 "but a sharded model's grads are reduced across ranks and carry no graph; use a first-order "
                 "optimizer over shards(model) (AdamW, Adafactor, Lion, Muon), or train this model unsharded")
REFUSED = {"AdaHessian": _SECOND_ORDER, "SophiaH": _SECOND_ORDER}
"""Optimizers (by class name) that no path can make exact, and why, with the way out."""

ELEMENT_WISE_WRAPPERS = {"Lookahead": "optimizer"}
"""Wrappers (by class name) whose own update is element-wise, and the attribute holding the optimizer
they wrap: they take that optimizer's path (Lookahead: a blend of fast and slow weights)."""


def _listed(optimizer: torch.optim.Optimizer, listing: dict[str, Optional[str]]) -> Optional[str]:
    """The class name in ``listing`` that ``optimizer`` is an instance of, where its groups set the option."""
    for cls in type(optimizer).__mro__:
        if cls.__name__ in listing:
            option = listing[cls.__name__]
            if option is None or any(g.get(option) for g in optimizer.param_groups):
                return cls.__name__ + (f" with {option}" if option else "")
    return None


def verdict(optimizer: torch.optim.Optimizer) -> Optional[Verdict]:
    """The path of ``optimizer`` from the lists and its wrapped optimizer; None where it is to be probed."""
    if type(optimizer) in ELEMENT_WISE:
        return Verdict(SHARD, "listed element-wise")
    if type(optimizer).__name__ == "SparseAdam":
        raise RuntimeError("parts.partition: SparseAdam steps sparse grads, but the grad shards of a sharded model "
                           "are dense; use torch.optim.Adam or AdamW over shards(model)")
    for cls in type(optimizer).__mro__:
        if cls.__name__ in REFUSED:
            raise RuntimeError(f"parts.partition: {type(optimizer).__name__} cannot step a sharded model: "
                               f"{REFUSED[cls.__name__]}")
    listed = _listed(optimizer, COUPLED)
    if listed is not None:
        return Verdict(REPLICATED, f"listed as coupling tensors: {listed}")
    listed = _listed(optimizer, PER_TENSOR)
    if listed is not None:
        return Verdict(WHOLE, f"listed as needing each tensor whole: {listed}")
    inner = getattr(optimizer, ELEMENT_WISE_WRAPPERS.get(type(optimizer).__name__, ""), None)
    if isinstance(inner, torch.optim.Optimizer):
        found = verdict(inner) or probe(inner)
        return Verdict(found.path, f"its own update is element-wise; the {type(inner).__name__} it wraps: {found.why}",
                       found.probed)
    return None


def choose(optimizer: torch.optim.Optimizer, path: Optional[str]) -> Verdict:
    """``path`` if given, else the lists' answer, else the probe's."""
    if path is not None:
        if path not in PATHS:
            raise ValueError(f"parts.partition.route: path must be one of {PATHS} or None, got {path!r}")
        return Verdict(path, "named by route(optimizer, path)")
    return verdict(optimizer) or probe(optimizer)


def needs_whole(optimizer: torch.optim.Optimizer) -> bool:
    """True if ``optimizer``'s update of a tensor differs from that of its flat pieces (path whole or replicated)."""
    return choose(optimizer, None).path != SHARD


def describe(optimizer: Any) -> str:
    """The optimizer's class name for messages."""
    return type(optimizer).__name__
