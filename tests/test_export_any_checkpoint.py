"""``python -m parts.export`` of any DCP checkpoint: the README's ``{"model": ..., "optimizer": ...}``,
one model under ``model`` alone, a checkpoint with nested dicts, bytes and objects beside the
model. The model is found under its top-level key, its keys are checked against the config's
architecture, and ``from_pretrained`` loads the trained weights bit for bit; keys that the
architecture does not load are refused, naming ``--prefix``."""

import os

import pytest
import torch

from harness import run

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _config() -> "transformers.GPT2Config":
    return transformers.GPT2Config(n_layer=2, n_embd=24, n_head=2, vocab_size=61, n_positions=20,
                                   bos_token_id=0, eos_token_id=0)


def _trained_saves(folder: str) -> dict:
    """A GPT-2 built under ``partitioned()``, attached, trained a step with AdamW, then saved as the
    README saves it (``readme``), its model alone under ``model`` (``model_only``), the README's with
    a nested dict of a step, a name and an RNG state beside it (``extras``) and without the tied
    ``lm_head.weight`` (``untied_key``); the config beside each but ``bare``. Its full state dict."""
    import torch.distributed as dist
    from parts.comm import dcp
    from parts.partition import (attach, full_state_dict, partitioned, shards, sharded_optimizer_state_dict,
                                 sharded_state_dict)
    torch.manual_seed(0)
    with partitioned():
        model = transformers.GPT2LMHeadModel(_config())
    attach(model)
    optimizer = torch.optim.AdamW(shards(model), lr=1e-2)
    ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    state = {"model": sharded_state_dict(model), "optimizer": sharded_optimizer_state_dict(model, optimizer)}
    without_tie = {k: v for k, v in state["model"].items() if k != "lm_head.weight"}
    saves = {"readme": state, "bare": state, "model_only": {"model": state["model"]},
             "extras": {**state, "train": {"step": 1, "run": {"name": "a", "rng": torch.get_rng_state()}}},
             "untied_key": {"model": without_tie, "optimizer": state["optimizer"]}}
    for name, content in saves.items():
        dcp.save(content, checkpoint_id=os.path.join(folder, name))
        if dist.get_rank() == 0 and name != "bare":
            model.config.save_pretrained(os.path.join(folder, name))
    dist.barrier()
    return full_state_dict(model, rank0_only=False)


@pytest.fixture(scope="module", params=[2, 3])
def saved(request, tmp_path_factory) -> tuple:
    folder = tmp_path_factory.mktemp(f"world{request.param}")
    return folder, run(request.param, _trained_saves, str(folder), timeout=180)[0]


def _loads_as_trained(out, full: dict) -> None:
    """``from_pretrained`` of ``out`` misses no weight and equals the trained model bit for bit."""
    model, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    loaded = model.state_dict()
    assert set(full) == set(loaded)
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in full.items())


@pytest.mark.parametrize("name", ["readme", "model_only", "extras", "untied_key"])
def test_cli_exports_the_model_of_a_checkpoint_that_holds_more_and_from_pretrained_loads_it(
        saved, tmp_path, capsys, name):
    from parts.export.__main__ import main
    folder, full = saved
    assert main([str(folder / name), str(tmp_path / "hf")]) == 0
    line = capsys.readouterr().out
    assert "under 'model'" in line and "keys checked against GPT2LMHeadModel" in line
    if name != "model_only":
        assert "left out the checkpoint's entries" in line and "'optimizer'" in line
    _loads_as_trained(tmp_path / "hf", full)


def test_cli_with_prefix_model_exports_the_readme_checkpoint(saved, tmp_path):
    from parts.export.__main__ import main
    folder, full = saved
    assert main([str(folder / "readme"), str(tmp_path / "hf"), "--prefix", "model"]) == 0
    _loads_as_trained(tmp_path / "hf", full)


def test_export_without_config_strips_the_one_top_level_key_and_a_given_config_is_checked_and_copied(
        saved, tmp_path):
    from safetensors.torch import load_file

    from parts.export import export
    folder, full = saved
    result = export(folder / "bare", tmp_path / "plain")
    assert result.prefix == "model" and result.left_out == ["optimizer"] and "not checked" in result.checked
    got = load_file(tmp_path / "plain" / "model.safetensors")
    assert got.keys() == full.keys() and all(torch.equal(got[k], v) for k, v in full.items())
    result = export(folder / "bare", tmp_path / "hf", config=folder / "readme")  # an HF model folder
    assert result.checked.startswith("keys checked against GPT2LMHeadModel")
    _loads_as_trained(tmp_path / "hf", full)


def test_keys_the_architecture_does_not_load_are_refused_naming_prefix(saved, tmp_path):
    from parts.export.__main__ import main
    folder, _ = saved
    with pytest.raises(ValueError, match=r"--prefix 'model'.*") as kept:
        main([str(folder / "readme"), str(tmp_path / "hf"), "--prefix", ""])
    assert "'model.lm_head.weight'" in str(kept.value) and "'transformer.wte.weight'" in str(kept.value)
    llama = transformers.LlamaConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, vocab_size=61)
    llama.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*--prefix") as other:
        main([str(folder / "readme"), str(tmp_path / "hf"), "--config", str(tmp_path / "llama")])
    assert "model.embed_tokens.weight" in str(other.value)
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf*"))
