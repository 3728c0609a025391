"""peft's ``merge_and_unload`` on an attached sharded LoRA model reaches the shards: what
``sharded_state_dict`` gives (and so DCP and export) is the merge of the unsharded peft model,
bitwise, at world 2 and 3."""

from __future__ import annotations

import warnings

import pytest
import torch

from harness import run

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _config() -> "transformers.LlamaConfig":
    return transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2, vocab_size=37, max_position_embeddings=16)


def _lora(model):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian",
                             lora_dropout=0.0)
    with warnings.catch_warnings():  # peft reads a transformers attribute deprecated in its favour
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return peft.get_peft_model(model, config)


def merge_sharded(path: str, reattach: bool = False) -> bool:
    """Train a step, merge, (``reattach``: detach and attach the merged model first) save through DCP,
    load into a fresh model: equal to the unsharded peft merge, bitwise?"""
    from parts.comm import dcp
    from parts.partition import (attach, detach, full_state_dict, load_sharded_state_dict, partitioned,
                                 sharded_state_dict, shards)
    torch.manual_seed(0)
    with partitioned():
        base = transformers.LlamaForCausalLM(_config())
    with partitioned():
        model = _lora(base)
    attach(model)
    optimizer = torch.optim.AdamW(shards(model), lr=1e-2)
    ids = (torch.arange(16).reshape(2, 8) * 3) % 37
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    model(input_ids=ids)  # the kept-gathered weights are current again
    trained = full_state_dict(model, rank0_only=False)
    merged = model.merge_and_unload()
    if reattach:  # the merge lives in the kept-gathered copies, which detach releases
        detach(merged)
        attach(merged)
        merged(input_ids=ids)
    dcp.save(sharded_state_dict(merged), checkpoint_id=path)
    torch.manual_seed(1)
    with partitioned():
        fresh = transformers.LlamaForCausalLM(_config())
    state = sharded_state_dict(fresh)
    dcp.load(state, checkpoint_id=path)
    load_sharded_state_dict(fresh, state)
    reference = _lora(transformers.LlamaForCausalLM(_config()))
    reference.load_state_dict(trained, strict=True)
    want = reference.merge_and_unload().state_dict()
    got = full_state_dict(fresh, rank0_only=False)
    return got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("world", [2, 3])
def test_merge_and_unload_on_an_attached_model_reaches_the_shards(tmp_path, world: int) -> None:
    assert run(world, merge_sharded, str(tmp_path / "ckpt"), timeout=120.0) == [True] * world


def test_a_merge_survives_detach_and_attach(tmp_path) -> None:
    assert run(2, merge_sharded, str(tmp_path / "ckpt"), True, timeout=120.0) == [True, True]


def merge_in_bf16() -> str:
    from parts.partition import MixedPrecision, attach, detach, partitioned, sharded_state_dict, shards
    torch.manual_seed(0)
    with partitioned():
        base = transformers.LlamaForCausalLM(_config())
    with partitioned():
        model = _lora(base)
    attach(model, mixed_precision=MixedPrecision())
    optimizer = torch.optim.AdamW(shards(model), lr=1e-2)
    ids = torch.arange(8).reshape(1, 8)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # lora_B is no longer zero: the merge changes the weights
    model(input_ids=ids)  # the kept-gathered weights are bf16 copies
    merged = model.merge_and_unload()
    said = []
    for call in (sharded_state_dict, detach):  # detach too: it would release the only merged copies
        try:
            call(merged)
            said.append("no error")
        except RuntimeError as error:
            said.append(str(error))
    return said


def test_a_merge_into_bf16_copies_of_fp32_shards_raises_naming_the_way_out() -> None:
    for rank_said in run(2, merge_in_bf16, timeout=120.0):
        for said in rank_said:
            assert "q_proj.base_layer.weight" in said and "modifier_rank=0" in said and "refresh" in said, said
