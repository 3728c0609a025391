"""Models to plan from a Hugging Face config or a ``module:function``, built without data."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn


def hf_builder(config_path: str) -> Callable[[], nn.Module]:
    """A function building the model a Hugging Face ``config.json`` describes (no weights):
    causal LMs (Llama, Mistral, Qwen, GPT-2...), seq2seq (T5), masked LMs (BERT)."""
    import transformers

    path = Path(config_path)
    if not path.is_file():
        raise FileNotFoundError(f"parts.plan: no config file at {path}")
    config = transformers.AutoConfig.for_model(**json.loads(path.read_text()))
    kinds = (transformers.AutoModelForCausalLM, transformers.AutoModelForSeq2SeqLM,
             transformers.AutoModelForMaskedLM, transformers.AutoModel)
    for kind in kinds:
        if type(config) in kind._model_mapping:
            return lambda: kind.from_config(config, dtype=torch.float32)  # --dtype sets the widths
    raise ValueError(f"parts.plan: {path} describes a {config.model_type} model that no Auto class builds")


def config_dtype(config_path: str) -> Optional[str]:
    """The ``torch_dtype`` (or ``dtype``) a Hugging Face ``config.json`` declares, e.g. "bfloat16"; None if none."""
    path = Path(config_path)
    if not path.is_file():
        raise FileNotFoundError(f"parts.plan: no config file at {path}")
    declared = json.loads(path.read_text())
    value = declared.get("torch_dtype", declared.get("dtype"))
    return str(value).removeprefix("torch.") if value is not None else None


def function_builder(spec: str) -> Callable[[], nn.Module]:
    """``package.module:function`` -> that function (it must build and return the model)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"parts.plan: --model takes module:function, got {spec!r}")
    return getattr(importlib.import_module(module_name), attr)


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` sharded on the meta device over one rank: shapes and the parameter ids a real
    build gives (creation order), no memory, no init cost, no process group."""
    from parts.partition import partitioned

    with partitioned(device="meta"):
        return build()
