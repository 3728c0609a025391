"""Checks of a BF16Optimizer checkpoint before anything is loaded: names, shapes and dtypes.

No ``torch.distributed`` here: the checks read the saved dicts and the model's parameter
names and shapes only, so a bad checkpoint raises before the optimizer is touched.

Dtype rule: the fp32 master and every tensor of optimizer state (per-element or not) must be
floating point (a floating dtype other than fp32 is widened or kept as saved); an
integer or bool tensor there is an error. The one exception is the ``step`` counter, which
torch optimizers keep as a float or an integer: any real (non-bool, non-complex) dtype loads.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

COUNTER_KEYS = frozenset({"step"})
"""State keys that are step counters: integer or floating dtypes both load."""


def check_names(saved: Mapping[str, Sequence[int]], model: Mapping[str, Sequence[int]],
                strict: bool) -> None:
    """Raise naming the first model parameter missing from (or shaped unlike) the checkpoint,
    and, if ``strict``, the saved parameters the model does not have."""
    for name, shape in model.items():
        if name not in saved:
            raise KeyError(f"parameter {name!r} is not in the checkpoint")
        if list(saved[name]) != list(shape):
            raise ValueError(f"parameter {name!r}: checkpoint shape {list(saved[name])}, "
                             f"model shape {list(shape)}")
    extra = [name for name in saved if name not in model]
    if strict and extra:
        raise ValueError(f"the checkpoint has parameters the model does not: {extra}; load the "
                         f"checkpoint of this model, or pass strict=False to ignore them")


def check_dtypes(sds: Iterable[dict]) -> None:
    """Raise naming the parameter, state key and both dtypes of the first saved tensor of the
    wrong kind in ``sds`` (rank dicts or one consolidated dict)."""
    for sd in sds:
        if sd.get("kind") == "consolidated":
            _check_consolidated(sd)
        else:
            _check_rank(sd)


def _check_consolidated(sd: dict) -> None:
    for name, master in sd["master"].items():
        who = f"parameter {name!r}"
        _check_value(who, None, master)
        for key, value in {**sd["state"].get(name, {}), **sd["scalars"].get(name, {})}.items():
            _check_value(who, key, value)


def _check_rank(sd: dict) -> None:
    names: dict[tuple[str, int], list[str]] = {}
    for m in sd["params"]:
        names.setdefault((m["kind"], m["group"]), []).append(m["name"])
    for g, rec in enumerate(sd["groups"]):
        if rec is not None:
            listed = ", ".join(repr(n) for n in names.get(("flat", g), []))
            _check_record(f"param group {g} ({listed}) of saved rank {sd['rank']}", rec)
    for g, recs in enumerate(sd["sharded"]):
        sharded = names.get(("sharded", g), [])
        for j, rec in enumerate(recs):
            name = sharded[j] if j < len(sharded) else f"group{g}.sharded{j}"
            _check_record(f"parameter {name!r} of saved rank {sd['rank']}", rec)


def _check_record(who: str, rec: dict) -> None:
    _check_value(who, None, rec["master"])
    for key, value in {**rec["state"], **rec["scalars"]}.items():
        _check_value(who, key, value)


def _check_value(who: str, key: Any, value: Any) -> None:
    """Raise if tensor ``value`` (the master when ``key`` is None) has a dtype that cannot load."""
    if not torch.is_tensor(value):
        return
    dtype = value.dtype
    if key in COUNTER_KEYS:
        if dtype == torch.bool or dtype.is_complex:
            raise ValueError(f"checkpoint {who}: state {key!r} is {dtype}; expected an integer or "
                             f"floating-point step counter")
        return
    if not dtype.is_floating_point:
        what = "fp32 master" if key is None else f"state {key!r}"
        raise ValueError(f"checkpoint {who}: {what} is {dtype}, expected torch.float32 (or another "
                         f"floating-point dtype); was the checkpoint cast or corrupted?")


def _same(a: Any, b: Any) -> bool:
    """Option values equal (tensors by value, e.g. a tensor lr)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _same_options(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


def group_options(saved: Sequence[Mapping[str, Any]], saved_group: Mapping[str, int],
                  current: Sequence[Sequence[str]]) -> list[Optional[dict]]:
    """Per current param group, the saved settings (lr, ...) of the saved group its params were in.

    Parameters are matched by name, so groups listed in another order, or split or merged,
    get their own settings back (None: no saved parameter, settings kept). Raises naming the
    group and the parameters if one current group holds params saved with different settings."""
    out: list[Optional[dict]] = []
    for g, names in enumerate(current):
        sources = sorted({saved_group[n] for n in names if n in saved_group})
        if not sources:
            out.append(None)
            continue
        first = saved[sources[0]]
        for s in sources[1:]:
            if not _same_options(first, saved[s]):
                held = [n for n in names if saved_group.get(n) in (sources[0], s)]
                raise ValueError(
                    f"param group {g} holds parameters saved in param groups {sources[0]} and {s} "
                    f"with different settings ({dict(first)} vs {dict(saved[s])}): {held}; build "
                    f"the optimizer with those parameters in separate groups, as when saved")
        out.append(dict(first))
    return out
