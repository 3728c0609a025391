"""``parts.export`` of a LoRA run (the parts ``Trainer`` on a peft model, world 2): the adapter in
peft's layout by default, loadable by ``PeftModel.from_pretrained``; with ``--merge`` the plain
model, loadable by ``from_pretrained`` with no missing weight and equal to peft's own
``merge_and_unload`` of the same weights. ``from_pretrained`` of the adapter folder never
"loads" a model with every weight missing."""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import pytest
import torch

from harness import run

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")
from test_export_output import Rows  # noqa: E402
SLOW = 120.0


def _config() -> "transformers.LlamaConfig":
    return transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2, vocab_size=37, max_position_embeddings=16)


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():  # peft reads a transformers attribute deprecated in its favour
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        yield


def _lora(model):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian",
                             lora_dropout=0.0)
    with _quiet():
        return peft.get_peft_model(model, config)


def train_lora(out: str) -> dict:
    from parts.integrations.transformers import Trainer
    from parts.partition import full_state_dict, partitioned
    torch.manual_seed(0)
    with partitioned():
        base = transformers.LlamaForCausalLM(_config())
    with partitioned():
        model = _lora(base)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # accelerate warns without it; workers run one thread
    args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=2, save_steps=2,
                                          learning_rate=1e-2, report_to=[], use_cpu=True, logging_steps=100,
                                          save_only_model=True, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=Rows()).train()
    return full_state_dict(model, rank0_only=False)


def _base(trained: dict) -> "transformers.LlamaForCausalLM":
    """The plain model holding the run's base weights."""
    from parts.export.peft import merged_key
    model = transformers.LlamaForCausalLM(_config())
    model.load_state_dict({merged_key(k): v for k, v in trained.items() if "lora_" not in k}, strict=True)
    return model


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("lora") / "runA"
    trained = run(2, train_lora, str(out), timeout=SLOW)[0]
    return out / "checkpoint-2", trained


def test_a_lora_run_exports_its_adapter_loadable_by_peft(lora_run, tmp_path: Path, monkeypatch) -> None:
    from parts.export import export
    checkpoint, trained = lora_run
    result = export(checkpoint, tmp_path / "adapter")
    assert result.kind == "adapter"
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    with _quiet():
        loaded = peft.PeftModel.from_pretrained(_base(trained), tmp_path / "adapter").state_dict()
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], v) for k, v in trained.items())
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in trained.items())
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # the adapter names no base model
    with pytest.raises(OSError):  # it looks for the base model: never every weight re-initialised
        transformers.LlamaForCausalLM.from_pretrained(tmp_path / "adapter")


def test_a_lora_run_exports_the_merged_model_on_request(lora_run, tmp_path: Path) -> None:
    from parts.export.__main__ import main
    checkpoint, trained = lora_run
    assert main([str(checkpoint), str(tmp_path / "merged"), "--merge"]) == 0
    reference = _lora(_base(trained))
    reference.load_state_dict(trained, strict=True)
    want = reference.merge_and_unload().state_dict()
    model, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(got[q], trained[f"base_model.model.{q.replace('.weight', '.base_layer.weight')}"])
