"""Pretrained weights straight into shards, and the size of a sharded model.

``load_pretrained(model, path_or_files)`` fills a model built under ``partitioned()`` (or
``partition_module``) from safetensors files: one file, a list, or a directory (Hugging
Face's sharded ``*.safetensors`` with ``model.safetensors.index.json``, or every
``*.safetensors`` in it). Each rank opens the files and reads, for every sharded
parameter, only the rows that hold its shard (``safe_open(...).get_slice``): no rank ever
holds a full model, and there is no collective at all. Buffers and unsharded parameters
are read whole. Names follow Hugging Face: a key may carry or lack the model's
``base_model_prefix`` (``transformer.``, ``model.``...), and tied weights (one tensor under
several keys, e.g. ``lm_head.weight`` = ``wte.weight``) are loaded from whichever key the
files have. Missing and unexpected keys are returned like ``load_state_dict``'s, or raised
with ``strict=True``; a shape mismatch always raises. Needs ``safetensors``
(``pip install "parts[hf]"``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

from parts._compat import incompatible_keys
from parts.partition.core import disk
from parts.partition.core.param import internal, is_partitioned, meta
from parts.partition.interop.slices import covering_rows

INDEX = "model.safetensors.index.json"
PathLike = Union[str, os.PathLike, Iterable[Union[str, os.PathLike]]]


def num_parameters(model: nn.Module, only_trainable: bool = False) -> int:
    """Elements of all parameters of ``model``, sharded ones at their global size (tied once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen or (only_trainable and not p.requires_grad):
            continue
        seen.add(id(p))
        total += meta(p).numel if is_partitioned(p) else p.numel()
    return total


def _files(path_or_files: PathLike) -> list[str]:
    """The safetensors files named by a file, a directory (index first) or a list."""
    if isinstance(path_or_files, (str, os.PathLike)):
        path = os.fspath(path_or_files)
        if not os.path.isdir(path):
            return [path]
        index = os.path.join(path, INDEX)
        if os.path.exists(index):
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        else:
            names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not names:
            raise FileNotFoundError(f"load_pretrained: no *.safetensors files in {path}")
        return [os.path.join(path, n) for n in names]
    return [os.fspath(p) for p in path_or_files]


def _candidates(key: str, prefix: str) -> list[str]:
    """Checkpoint names a model key may have: itself, without or with the base-model prefix."""
    out = [key]
    if prefix and key.startswith(prefix + "."):
        out.append(key[len(prefix) + 1:])
    elif prefix:
        out.append(f"{prefix}.{key}")
    return out


def _plan(own: dict, where: dict, prefix: str, key_map: Optional[Callable[[str], str]]) -> tuple:
    """``{id(tensor): (model_key, ckpt_key)}`` for every tensor found, then missing, unexpected."""
    found: dict[int, tuple[str, str]] = {}
    for k, v in own.items():
        if id(v) in found:
            continue
        names = [key_map(k)] if key_map is not None else _candidates(k, prefix)
        hit = next((n for n in names if n in where), None)
        if hit is not None:
            found[id(v)] = (k, hit)
    used = {ck for _, ck in found.values()}
    missing = [k for k, v in own.items() if id(v) not in found]
    unexpected = [k for k in where if k not in used]
    return found, missing, unexpected


def _read_shard(p: torch.Tensor, f: Any, key: str) -> None:
    """Read only the rows holding this rank's shard of ``p`` and write the shard."""
    m = meta(p)
    sl = f.get_slice(key)
    shape = list(sl.get_shape())
    if shape != list(m.shape):
        raise RuntimeError(f"load_pretrained: size mismatch for '{key}': checkpoint {tuple(shape)}, "
                           f"model {tuple(m.shape)}")
    start, stop = m.layout.range(m.rank)
    first, last, offset = covering_rows(shape, start, stop)
    n = stop - start
    rows = None if not n else sl[first:last] if shape else f.get_tensor(key)
    with torch.no_grad(), disk.rewrite(m.shard):
        if rows is not None:
            m.shard[:n].copy_(rows.reshape(-1)[offset:offset + n])
        m.shard[n:].zero_()


def _read_whole(t: torch.Tensor, f: Any, key: str) -> None:
    value = f.get_tensor(key)
    if tuple(value.shape) != tuple(t.shape):
        raise RuntimeError(f"load_pretrained: size mismatch for '{key}': checkpoint "
                           f"{tuple(value.shape)}, model {tuple(t.shape)}")
    with torch.no_grad():
        t.copy_(value)


def _open(path: str) -> Any:
    try:
        from safetensors import safe_open
    except ImportError as err:
        raise ImportError("load_pretrained needs safetensors: pip install safetensors "
                          "(or parts[hf])") from err
    return safe_open(path, framework="pt", device="cpu")


@internal
def load_pretrained(model: nn.Module, path_or_files: PathLike, *, strict: bool = True,
                    key_map: Optional[Callable[[str], str]] = None) -> Any:
    """Fill ``model``'s shards (and buffers) from safetensors files, each rank reading its slices."""
    files = _files(path_or_files)
    handles = {path: _open(path) for path in files}
    where = {k: path for path, f in handles.items() for k in f.keys()}
    own = model.state_dict(keep_vars=True)
    found, missing, unexpected = _plan(own, where, getattr(model, "base_model_prefix", ""), key_map)
    if strict and (missing or unexpected):
        raise RuntimeError(f"load_pretrained: error(s) loading {type(model).__name__} from {files}: "
                           f"missing keys {missing}; unexpected keys {unexpected} "
                           f"(strict=False returns them instead)")
    for k, t in own.items():
        if id(t) not in found or found[id(t)][0] != k:
            continue
        ck = found[id(t)][1]
        f = handles[where[ck]]
        if is_partitioned(t):
            _read_shard(t, f, ck)
        else:
            _read_whole(t, f, ck)
    return incompatible_keys(missing, unexpected)
