"""The probe: which path an optimizer needs, found by stepping copies of it on small tensors.

For each distinct param group, copies of the optimizer (a deep copy of the instance's attributes
with that group's options and small tensors swapped in: its ``__init__`` never runs again) step
two 2-D tensors for ``TRIAL_STEPS`` steps, the grads changing scale from step to step, from
row to row and from tensor to tensor, and depending on the values (a quadratic loss, which a
closure returns where ``step`` takes one). Three trials are compared with the first:

- both tensors in one copy (what one process does);
- each tensor in a copy of its own: a difference means the update couples tensors (a global
  sum or norm), and so does a closure called other than once per step: the replicated path;
- each tensor cut in two flat pieces, the first pieces in one copy and the second in
  another (what two ranks' shards are): a difference, or a refusal of flat pieces, means the
  update needs each tensor whole: the whole path; else the shard path.

The copies hold none of the user's tensors: where an optimizer it holds keeps them in lists of
its own, a copy holds stand-ins without values or grads, which a step skips. Copies that leave
the probe's tensors where they were (their step steps only optimizers they hold) show nothing:
the replicated path.

State an optimizer made before its first step is remade for the copies' tensors where its
recipe shows (a copy of the values, a constant fill: Adagrad, Lookahead). An optimizer that
cannot be copied, holds other state before its first step, or steps no plain 2-D tensor takes
the replicated path, which is exact for any update. The probe is a heuristic:
paths.py backs it with a list of optimizers known to be element-wise and one of optimizers
known to couple tensors. Random-number generators (torch's, Python's, numpy's) are left as they
were, and the copies' warnings are not shown.
"""

from __future__ import annotations

import copy
import inspect
import logging
import random
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from parts.partition.whole import early_state

logger = logging.getLogger("parts.partition")

SHARD, WHOLE, REPLICATED = "shard", "whole", "replicated"
ORDER = (SHARD, WHOLE, REPLICATED)
"""The paths from the cheapest to the one that holds for any optimizer."""

TRIAL_STEPS = 5
_STEP_SCALES = (1.0, 1e-3, 40.0, 0.25, 7.0)
_TENSOR_SCALES = (1.0, 30.0)
_SHAPES = ((6, 5), (4, 3))
_CUTS = (13, 5)  # each tensor as two flat pieces: neither a row boundary nor a half
_CURVATURE = 0.3
_TOL = {torch.float64: 1e-10, torch.float32: 1e-5}

UNMOVED = ("its copies left the probe's tensors where they were (it steps tensors its param groups do not "
           "hold: optimizers it holds over groups of their own)")
"""Why a probe that could not see the update chose the replicated path."""

Piece = tuple[int, Optional[int], Optional[int]]  # (tensor, start, stop): a flat piece, or the whole tensor


@dataclass(frozen=True)
class Verdict:
    """A path and why."""

    path: str
    why: str
    probed: bool = False  # found by stepping copies (so each rank's answer is checked against the others')


def strictest(verdicts: list[Verdict]) -> Verdict:
    """The verdict with the path that holds for all of them."""
    return max(verdicts, key=lambda v: ORDER.index(v.path))


def family(optimizer: Any) -> list[torch.optim.Optimizer]:
    """``optimizer`` and the optimizers it holds that share its param groups (Lookahead's, SAM's)."""
    out = [optimizer]
    for value in list(vars(optimizer).values()):
        if isinstance(value, torch.optim.Optimizer) and value is not optimizer and \
                value.param_groups is optimizer.param_groups:
            out.extend(o for o in family(value) if all(o is not seen for seen in out))
    return out


def _templates(optimizer: torch.optim.Optimizer) -> Optional[list[early_state.Template]]:
    """Per optimizer of ``family(optimizer)``: the recipe of its state made before stepping (None: unknown)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    found = [early_state.template(o, params) for o in family(optimizer)]
    return None if any(t is None for t in found) else found


def _clone(optimizer: torch.optim.Optimizer, memo: dict) -> torch.optim.Optimizer:
    """A deep copy of every attribute of ``optimizer`` (torch's ``__getstate__`` keeps three only),
    the optimizers it holds cloned the same way."""
    if id(optimizer) in memo:
        return memo[id(optimizer)]
    twin = object.__new__(type(optimizer))
    memo[id(optimizer)] = twin
    for value in vars(optimizer).values():
        if isinstance(value, torch.optim.Optimizer):
            _clone(value, memo)
    twin.__dict__.update(copy.deepcopy(vars(optimizer), memo))
    return twin


def _user_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors in the param groups of ``optimizer`` and of the optimizers it shares them with."""
    return [p for o in family(optimizer) for g in o.param_groups for p in g["params"]]


def _stand_in(p: torch.Tensor) -> torch.Tensor:
    """What a copy holds where the user's optimizer holds ``p`` outside the groups the probe swaps (an
    optimizer it holds over the same tensors): no values and no grad, so a step skips it."""
    return torch.empty(p.shape, dtype=p.dtype, device="meta")


def _twin(optimizer: torch.optim.Optimizer, group: dict, tensors: list[torch.Tensor],
          templates: list[early_state.Template]) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` with one group of ``group``'s options over ``tensors`` and the state it
    made before stepping remade for them (its tensors and modules are not copied: the copy's groups
    and state are replaced)."""
    memo: dict[int, Any] = {id(p): _stand_in(p) for p in _user_tensors(optimizer)}
    for o in family(optimizer):
        for entry in o.state.values():
            if isinstance(entry, dict):
                memo.update((id(v), v) for v in entry.values() if torch.is_tensor(v))
        memo.update((id(v), v) for v in vars(o).values() if isinstance(v, nn.Module))
    twin = _clone(optimizer, memo)
    options = copy.deepcopy({k: v for k, v in group.items() if k != "params"})
    if isinstance(options.get("lr"), (int, float)) and options["lr"] == 0:
        options["lr"] = 1e-2  # a zero step shows no difference
    twin.param_groups[:] = [{**options, "params": tensors}]
    for o, recipe in zip(family(twin), templates):
        o.state.clear()
        if recipe:
            o.state.update((t, early_state.make(recipe, t)) for t in tensors)
    return twin


def _takes_closure(optimizer: torch.optim.Optimizer) -> bool:
    try:
        return "closure" in inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):
        return False


class _Problem:
    """The trials' tensors, grads and loss: the same numbers for a whole tensor and for its pieces."""

    def __init__(self, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(0)
        self.start = [torch.randn(s, generator=gen, dtype=dtype) for s in _SHAPES]
        rows = [torch.logspace(-2, 1, s[0], dtype=dtype).view(-1, 1) for s in _SHAPES]
        self.grads = [[(torch.randn(s, generator=gen, dtype=dtype) * r * k * scale).reshape(-1)
                       for s, r, k in zip(_SHAPES, rows, _TENSOR_SCALES)] for scale in _STEP_SCALES]

    def tensor(self, piece: Piece) -> torch.Tensor:
        i, lo, hi = piece
        return self.start[i].clone() if lo is None else self.start[i].reshape(-1)[lo:hi].clone()

    def set_grads(self, pieces: list[Piece], tensors: list[torch.Tensor], step: int) -> torch.Tensor:
        """Give ``tensors`` their grads of ``step`` at their current values; the loss."""
        loss = torch.zeros((), dtype=tensors[0].dtype)
        for (i, lo, hi), t in zip(pieces, tensors):
            g = self.grads[step][i][slice(lo, hi)].view(t.shape)
            x = t.detach()
            t.grad = g + _CURVATURE * x
            loss = loss + (g * x).sum() + 0.5 * _CURVATURE * (x * x).sum()
        return loss


def _trial(optimizer: torch.optim.Optimizer, group: dict, problem: _Problem, copies: list[list[Piece]],
           templates: list[early_state.Template]) -> tuple[dict[int, torch.Tensor], int]:
    """Each list of pieces stepped by its own copy; the tensors' final flat values and the most
    closure calls one step made (0 without a closure)."""
    out: dict[int, list[torch.Tensor]] = {}
    most = 0
    for pieces in copies:
        tensors = [problem.tensor(p) for p in pieces]
        twin = _twin(optimizer, group, tensors, templates)
        closure_taken = _takes_closure(twin)
        torch.manual_seed(0)
        for step in range(TRIAL_STEPS):
            calls = [0]

            def closure() -> torch.Tensor:
                calls[0] += 1
                return problem.set_grads(pieces, tensors, step)
            problem.set_grads(pieces, tensors, step)
            if closure_taken:
                twin.step(closure)
                most = max(most, calls[0])
            else:
                twin.step()
        for (i, _, _), t in zip(pieces, tensors):
            out.setdefault(i, []).append(t.detach().reshape(-1))
    return {i: torch.cat(v) for i, v in out.items()}, most


def _differ(got: dict[int, torch.Tensor], want: dict[int, torch.Tensor], problem: _Problem, tol: float) -> bool:
    moved = max(float((want[i] - problem.start[i].reshape(-1)).abs().max()) for i in want)
    return any(not bool(((got[i] - want[i]).abs() <= tol * moved).all()) for i in want)


def _group_verdict(optimizer: torch.optim.Optimizer, group: dict, templates: list) -> Verdict:
    for dtype in (torch.float64, torch.float32):
        problem = _Problem(dtype)
        try:
            together, calls = _trial(optimizer, group, problem, [[(0, None, None), (1, None, None)]], templates)
        except Exception as error:  # any error: this dtype or plain 2-D tensors are not for it
            logger.debug("parts.partition: probing %s in %s: %s", type(optimizer).__name__, dtype, error)
            continue
        tol = _TOL[dtype]
        if any(torch.equal(together[i], problem.start[i].reshape(-1)) for i in together):
            return Verdict(REPLICATED, UNMOVED)
        if calls > 1:
            return Verdict(REPLICATED, f"its step calls the closure {calls} times")
        try:
            alone, _ = _trial(optimizer, group, problem, [[(0, None, None)], [(1, None, None)]], templates)
        except Exception as error:
            return Verdict(REPLICATED, f"it refuses one tensor alone ({type(error).__name__})")
        if _differ(alone, together, problem, tol):
            return Verdict(REPLICATED, "its update of each tensor depends on the other tensors")
        try:
            cut, _ = _trial(optimizer, group, problem, [[(0, 0, _CUTS[0]), (1, 0, _CUTS[1])],
                                                        [(0, _CUTS[0], None), (1, _CUTS[1], None)]], templates)
        except Exception as error:
            return Verdict(WHOLE, f"it refuses flat pieces of a tensor ({type(error).__name__})")
        if _differ(cut, together, problem, tol):
            return Verdict(WHOLE, "its update of a tensor differs from that of the same values in flat pieces")
        return Verdict(SHARD, "its update of each tensor equals that of the same values in flat pieces")
    return Verdict(REPLICATED, "it steps no pair of plain 2-D tensors in the probe")


def _distinct_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    seen, out = set(), []
    for g in optimizer.param_groups:
        key = repr(sorted((k, repr(v)) for k, v in g.items() if k != "params"))
        if key not in seen:
            seen.add(key)
            out.append(g)
    return out


def probe(optimizer: torch.optim.Optimizer) -> Verdict:
    """The path ``optimizer``'s update needs, found by stepping copies of it (random generators kept)."""
    templates = _templates(optimizer)
    if templates is None:
        return Verdict(REPLICATED, "it holds state made before its first step that the probe cannot remake",
                       probed=True)
    state, numpy = random.getstate(), sys.modules.get("numpy")  # numpy only where something imported it
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the copies' warnings are not the user's (nor errors under -W error)
            found = strictest([_group_verdict(optimizer, g, templates) for g in _distinct_groups(optimizer)])
    except Exception as error:  # it cannot be copied (or a copy fails in a way a trial does not catch)
        found = Verdict(REPLICATED, f"it cannot be probed ({type(error).__name__}: {error})")
    finally:
        random.setstate(state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)
    return Verdict(found.path, found.why, probed=True)
