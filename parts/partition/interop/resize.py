"""``resize_token_embeddings`` of a Hugging Face model sharded by parts, equal to the plain model's.

Hugging Face resizes by building a new ``nn.Embedding`` (or ``nn.Linear`` head), initialising
it, copying the old rows and assigning ``weight.data`` of another shape: none of that can
happen behind shards. So a model built under ``partitioned()`` (or ``partition_module``) gets
this function as its ``resize_token_embeddings`` (an instance attribute, installed at
construction through ``on_sharded`` on every module whose class has one), and it:

1. gathers the input and output embeddings' sharded params (one collective) and puts plain
   full copies in their place (tied weights stay one parameter);
2. runs the class's own ``resize_token_embeddings`` on them with sharding paused (inside a
   ``partitioned()`` context too): the same code, RNG draws and tying as the plain model, so
   old rows are kept bitwise and new rows are drawn as Hugging Face draws them;
3. shards the resulting embedding params again (one broadcast from rank 0: every rank ends
   with rank 0's new rows, i.e. what the plain model resized with rank 0's RNG state holds).

A rank holds the full embedding (and untied head) for the duration, as DeepSpeed's
``GatheredParameters`` does. Not on an attached model (its coordinator planned its fetches
over the old parameters): resize before ``attach``, or ``detach``, resize, ``attach``. An
optimizer built before the resize steps the old shards: build it after.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Optional

from torch import nn

from parts.partition.construction.construct import _DISABLED, _SPEC, on_sharded, partitioned, shard_new
from parts.partition.core import disk
from parts.partition.core.gather import gathered
from parts.partition.core.param import is_partitioned, meta, unique_params
from parts.partition.core.sharding import ShardSpec
from parts.partition.interop.convert import is_attached
from parts.partition.interop.overrides import install_method

_METHOD = "resize_token_embeddings"


def _embedding_params(model: nn.Module) -> list[nn.Parameter]:
    """The params of the model's input and output embedding modules (tied ones once)."""
    mods = [model.get_input_embeddings(), model.get_output_embeddings()]
    return unique_params(p for mod in mods if mod is not None for p in mod.parameters())


def _spec(params: list[nn.Parameter]) -> ShardSpec:
    """Where the re-sharded params go: the group, devices and pinning of the old ones."""
    m = meta(params[0])
    for p in params:
        if disk.parked_version(meta(p).shard) is not None:
            raise NotImplementedError(
                f"resize_token_embeddings: {meta(p).describe()} has its shard on disk; build the "
                f"model at the new vocabulary size and load the weights (load_full_state_dict)")
        if meta(p).info.group is not m.info.group or meta(p).device != m.device:
            raise ValueError(f"resize_token_embeddings: {meta(p).describe()} and {m.describe()} are "
                             f"sharded over different groups or devices")
    remote = m.shard.device if m.shard.device != m.device else None
    return ShardSpec(m.info, None, m.device, remote, m.shard.is_pinned())


def _unshard(model: nn.Module, params: list[nn.Parameter]) -> None:
    """Replace ``params`` everywhere in ``model`` by plain full copies (one gather)."""
    with gathered(params):
        plain = {id(p): nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in params}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None and id(p) in plain:
                mod._parameters[name] = plain[id(p)]


@contextlib.contextmanager
def _plain_build(model: nn.Module, spec: Optional[ShardSpec]) -> Iterator[None]:
    """Modules built and params assigned inside stay unsharded (new modules get ``spec`` after)."""
    before = {id(mod) for mod in model.modules()}
    hidden = [(mod, mod.__dict__.pop(_SPEC)) for mod in model.modules() if _SPEC in mod.__dict__]
    try:
        with partitioned(enabled=False):
            yield
    finally:
        for mod, old in hidden:
            mod.__dict__[_SPEC] = old
        for mod in model.modules():
            if id(mod) not in before:
                mod.__dict__.pop(_DISABLED, None)
                if hidden and spec is not None:
                    mod.__dict__[_SPEC] = spec


def resize_token_embeddings(model: nn.Module, new_num_tokens: Optional[int] = None,
                            pad_to_multiple_of: Optional[int] = None, mean_resizing: bool = True) -> Any:
    """Hugging Face's ``resize_token_embeddings`` for a sharded model (a collective); returns
    the input embeddings module, as Hugging Face does."""
    resize = getattr(type(model), _METHOD)
    old = [p for p in _embedding_params(model) if is_partitioned(p)]
    if not old:
        return resize(model, new_num_tokens, pad_to_multiple_of, mean_resizing)
    if is_attached(model):
        raise RuntimeError(
            f"resize_token_embeddings: {type(model).__name__} is attached to a FetchCoordinator, which "
            f"planned its fetches over the current {meta(old[0]).describe()}; resize before attach, or "
            f"parts.partition.detach(model), resize, attach(model) again")
    spec = _spec(old)
    _unshard(model, old)
    with _plain_build(model, spec):
        out = resize(model, new_num_tokens, pad_to_multiple_of, mean_resizing)
    shard_new(model, [p for p in _embedding_params(model) if not is_partitioned(p)], spec)
    return out


@on_sharded
def install_resize(modules: Iterable[nn.Module]) -> None:
    """Give every module whose class has ``resize_token_embeddings`` this one (once)."""
    install_method([mod for mod in modules if callable(getattr(type(mod), _METHOD, None))
                    and _METHOD not in mod.__dict__], _METHOD, resize_token_embeddings)
