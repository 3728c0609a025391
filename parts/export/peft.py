"""A peft LoRA checkpoint: the adapter in peft's own layout, or the base model with it merged.

A model wrapped by ``peft.get_peft_model`` saves keys such as
``base_model.model.<fqn>.base_layer.weight`` and ``<fqn>.lora_A.<adapter>.weight``. Written as
they are, ``from_pretrained`` would find none of its keys and initialise every weight afresh.
``adapter_entries`` renames the LoRA keys as ``PeftModel.save_pretrained`` does (adapter name
dropped), for ``adapter_model.safetensors`` beside the run's ``adapter_config.json``;
``merged_entries`` gives the plain model's keys, each LoRA target's weight merged as peft's
``merge_and_unload`` merges it: ``W + transpose(B @ A) * scaling`` (in float32 for half
precision adapters on CPU, as peft computes it), ``scaling = lora_alpha / r`` (``/ sqrt(r)``
with ``use_rslora``). Plain LoRA on linear layers only: DoRA, per-module rank or alpha
patterns, ``modules_to_save``, trained biases and embedding or convolution adapters are refused.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
_LORA = re.compile(r"\.(lora_[A-Za-z_]+)\.([^.]+)(?=\.|$)")


def is_peft(keys: Iterable[str]) -> bool:
    """Whether the checkpoint's keys are a peft LoRA model's."""
    return any(".lora_A." in k or ".lora_B." in k for k in keys)


def find_config(folders: Iterable[Path]) -> Path:
    """The run's ``adapter_config.json`` in the first of ``folders`` holding one."""
    folders = list(folders)
    for folder in folders:
        if (folder / ADAPTER_CONFIG).is_file():
            return folder / ADAPTER_CONFIG
    raise FileNotFoundError(
        f"export: the checkpoint holds a peft LoRA model, but no {ADAPTER_CONFIG} is in "
        f"{' or '.join(str(f) for f in folders)}; write it beside the checkpoint with "
        f"`model.peft_config['default'].save_pretrained(folder)` (the parts Trainer does)")


@dataclass(frozen=True)
class Lora:
    """What a merge needs of an adapter config: the adapter's name, its scaling, the weight layout."""

    adapter: str
    scaling: float
    fan_in_fan_out: bool

    @staticmethod
    def read(path: Path, adapter: str = "default") -> "Lora":
        """The LoRA settings of ``adapter_config.json`` at ``path``; ``ValueError`` for what a merge here cannot do."""
        config = json.loads(path.read_text(encoding="utf-8"))
        refused = [name for name, bad in (
            ("peft_type", config.get("peft_type", "LORA") != "LORA"), ("use_dora", config.get("use_dora")),
            ("rank_pattern", config.get("rank_pattern")), ("alpha_pattern", config.get("alpha_pattern")),
            ("modules_to_save", config.get("modules_to_save")), ("bias", config.get("bias", "none") != "none"),
            ("lora_bias", config.get("lora_bias"))) if bad]
        if refused:
            raise ValueError(f"export --merge: {path} sets {refused}; this export merges plain LoRA only. "
                             f"Export the adapter (without --merge) and merge it with peft's merge_and_unload")
        r = config["r"]
        scaling = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
        return Lora(adapter, scaling, bool(config.get("fan_in_fan_out")))


def adapter_key(key: str) -> Optional[str]:
    """``key`` as ``PeftModel.save_pretrained`` names it (``lora_A.default.weight`` -> ``lora_A.weight``),
    or None for a key that is not the adapter's."""
    return _LORA.sub(r".\1", key, count=1) if _LORA.search(key) else None


def merged_key(key: str) -> str:
    """The plain model's key of a peft model's base weight."""
    key = key[len(PREFIX):] if key.startswith(PREFIX) else key
    return key.replace(".base_layer.", ".")


def merge_plan(keys: Iterable[str], lora: Lora) -> dict[str, Optional[tuple[str, str]]]:
    """Each key the merged model keeps (base weights and everything not LoRA), mapped to the LoRA
    A and B keys merged into it (None: copied as it is)."""
    keys = list(keys)
    present = set(keys)
    plan: dict[str, Optional[tuple[str, str]]] = {}
    for key in keys:
        found = _LORA.search(key)
        if found:
            if found.group(1) not in ("lora_A", "lora_B"):
                raise ValueError(f"export --merge: {key} is a {found.group(1)} adapter; this export merges "
                                 f"LoRA on linear layers only (merge with peft's merge_and_unload)")
            continue
        owner = key[:-len(".base_layer.weight")] if key.endswith(".base_layer.weight") else None
        pair = (f"{owner}.lora_A.{lora.adapter}.weight", f"{owner}.lora_B.{lora.adapter}.weight") if owner else None
        plan[key] = pair if pair and pair[0] in present and pair[1] in present else None
    return plan


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, lora: Lora, key: str) -> torch.Tensor:
    """``weight`` with the LoRA update of ``a`` and ``b`` added, as peft's ``merge`` adds it."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"export --merge: the LoRA factors of {key} are not matrices ({tuple(a.shape)}, "
                         f"{tuple(b.shape)}); merge it with peft's merge_and_unload")
    half = b.dtype in (torch.float16, torch.bfloat16)
    delta = b.float() @ a.float() if half else b @ a
    delta = (delta.T if lora.fan_in_fan_out else delta) * lora.scaling
    return weight + (delta.to(b.dtype) if half else delta)


def reader_of(read_full: Callable[[str], torch.Tensor], lora: Lora, key: str,
              pair: tuple[str, str]) -> Callable[[], torch.Tensor]:
    """A function giving ``key``'s merged weight, reading it and its factors only when called."""
    return lambda: merge(read_full(key), read_full(pair[0]), read_full(pair[1]), lora, key)
