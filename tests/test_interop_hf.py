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


def _from_pretrained_case(folder: str) -> dict:
    import torch.distributed as dist
    from parts.partition import ParamStatus, attach, full_state_dict, is_partitioned, meta, partitioned
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(_config()).eval()
    if dist.get_rank() == 0:
        ref.save_pretrained(folder)
    dist.barrier()
    with partitioned():  # the DeepSpeed way: transformers builds on meta, each loaded weight is sharded
        model = transformers.GPT2LMHeadModel.from_pretrained(folder)
    params = list(model.parameters())
    sharded = all(is_partitioned(p) and meta(p).status is ParamStatus.NOT_AVAILABLE for p in params)
    shard_sizes = [meta(p).shard.numel() for p in params]
    full = full_state_dict(model, rank0_only=False)
    attach(model)
    model.eval()
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        loss, ref_loss = model(input_ids=x, labels=x).loss, ref(input_ids=x, labels=x).loss
    ref_sd = ref.state_dict()
    return dict(sharded=sharded, shard_sizes=shard_sizes, full_sizes=[meta(p).numel for p in params],
                equal=[k for k in ref_sd if not torch.equal(full[k], ref_sd[k])], keys=sorted(full) == sorted(ref_sd),
                tied=model.lm_head.weight is model.transformer.wte.weight, loss=loss, ref_loss=ref_loss)


def test_from_pretrained_inside_partitioned_shards_each_weight(tmp_path):
    # every weight is sharded as it is loaded (each rank keeps ceil(numel / 2)), equal bitwise to
    # the plain model's; the eval loss is computed by the same fp32 ops, so it is bitwise equal too
    for out in run(2, _from_pretrained_case, str(tmp_path), timeout=300):
        assert out["sharded"] and out["tied"] and out["keys"]
        assert all(s == (n + 1) // 2 for s, n in zip(out["shard_sizes"], out["full_sizes"]))
        assert out["equal"] == []
        assert torch.equal(out["loss"], out["ref_loss"])
