"""Hugging Face models with parts (issue 20), world 2; skipped without transformers (parts[hf])."""

import pytest
import torch

from harness import run

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _config():
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32)


def _gpt2_case(folder: str) -> dict:
    import torch.distributed as dist
    from parts.partition import attach, load_pretrained, num_parameters, partitioned
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(_config()).eval()
    if dist.get_rank() == 0:
        ref.save_pretrained(folder)  # one model.safetensors, the tied lm_head omitted
    dist.barrier()
    with partitioned():
        torch.manual_seed(1)
        model = transformers.GPT2LMHeadModel(_config())
    keys = load_pretrained(model, folder)
    attach(model)
    model.to("cpu").eval()  # what Trainer does: a no-op on the device the shards live on
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        loss, ref_loss = model(input_ids=x, labels=x).loss, ref(input_ids=x, labels=x).loss
    out = dict(keys=keys, loss=loss, ref_loss=ref_loss, n=num_parameters(model),
               ref_n=ref.num_parameters())
    try:
        model.resize_token_embeddings(100)
        out["resize"] = "no error"
    except RuntimeError as err:
        out["resize"] = str(err)
    return out


def test_gpt2_loads_pretrained_shards_and_matches(tmp_path):
    # eval mode, the same weights bitwise: the loss is computed by the same fp32 ops
    for out in run(2, _gpt2_case, str(tmp_path)):
        assert out["keys"].missing_keys == [] and out["keys"].unexpected_keys == []
        assert torch.equal(out["loss"], out["ref_loss"])
        assert out["n"] == out["ref_n"] > 0
        assert "resize_token_embeddings" in out["resize"] and "transformer.wte.weight" in out["resize"]
