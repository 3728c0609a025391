"""The keys a Hugging Face architecture loads, to check an export's keys against before it writes.

``config.json`` names the architecture (``architectures``; else its ``model_type``'s causal LM,
else its base model). The model is built on the meta device (no memory, no values): its
``state_dict`` keys are what ``from_pretrained`` fills. A tied weight (one parameter under
several names) needs one of its names; the keys of the base model alone (without
``base_model_prefix``), which ``from_pretrained`` also loads, match too; keys the architecture
declares it ignores on load count neither as missing nor as foreign. Custom code (``auto_map``)
is not run: such a config, or one transformers cannot build, is not checked, and says why.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Union

import torch


@dataclass(frozen=True)
class Layout:
    """The keys one model's ``from_pretrained`` loads: all, each parameter's names, names it ignores."""

    keys: frozenset[str]
    parameters: tuple[tuple[str, ...], ...]
    ignored_missing: tuple[str, ...]
    ignored_foreign: tuple[str, ...]

    def mismatch(self, keys: set[str]) -> tuple[list[str], list[str]]:
        """The parameters none of whose names is in ``keys``, and the keys that are not this model's."""
        missing = [names[0] for names in self.parameters if not any(n in keys for n in names)
                   and not any(re.search(p, names[0]) for p in self.ignored_missing)]
        foreign = sorted(k for k in keys if k not in self.keys
                         and not any(re.search(p, k) for p in self.ignored_foreign))
        return missing, foreign


@dataclass(frozen=True)
class Architecture:
    """A model class built from ``config``, with the layouts of keys that load into it."""

    name: str
    config: Path
    layouts: tuple[Layout, ...]

    def mismatch(self, keys: Iterable[str]) -> Optional[tuple[list[str], list[str]]]:
        """None when ``keys`` match a layout, else the missing and foreign keys of the closest one."""
        keys = set(keys)
        found = [layout.mismatch(keys) for layout in self.layouts]
        if any(not missing and not foreign for missing, foreign in found):
            return None
        return min(found, key=lambda pair: len(pair[0]) + len(pair[1]))


def _patterns(model: torch.nn.Module, name: str) -> tuple[str, ...]:
    return tuple(getattr(model, name, None) or ())


def _layout(model: torch.nn.Module) -> Layout:
    """The keys that load into ``model``; a parameter's names grouped (tied weights share one)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return Layout(frozenset(model.state_dict().keys()), tuple(tuple(n) for n in names.values()),
                  _patterns(model, "_keys_to_ignore_on_load_missing"),
                  _patterns(model, "_keys_to_ignore_on_load_unexpected"))


def _build(transformers, config) -> torch.nn.Module:  # noqa: ANN001 (transformers is optional)
    """The config's architecture on the meta device: its named class, else a causal LM, else the base model."""
    named = getattr(transformers, (config.architectures or [""])[0], None)
    with torch.device("meta"):
        if named is not None:
            return named(config)
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # no causal LM for this model_type
            return transformers.AutoModel.from_config(config)


def load(config: Path) -> Union[Architecture, str]:
    """The architecture ``config`` (a ``config.json``) names, built on meta; or why it is not checked."""
    try:
        import transformers
    except ImportError:
        return "transformers is not installed"
    if "auto_map" in json.loads(config.read_text(encoding="utf-8")):
        return f"{config} names custom code (auto_map), which export does not run"
    try:
        model = _build(transformers, transformers.AutoConfig.from_pretrained(str(config)))
    except Exception as error:  # an unknown model_type, a config this transformers cannot build
        return f"transformers cannot build the model of {config}: {type(error).__name__}: {error}"
    layouts = [_layout(model)]
    if model.base_model is not model:
        layouts.append(_layout(model.base_model))
    return Architecture(type(model).__name__, config, tuple(layouts))
