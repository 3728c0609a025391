"""Hugging Face models with parts, world 2; skipped without transformers (parts[hf])."""

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
    except RuntimeError as err:  # attached: its coordinator planned over the old params
        out["resize"] = str(err)
    return out


def test_gpt2_loads_pretrained_shards_and_matches(tmp_path):
    # eval mode, the same weights bitwise: the loss is computed by the same fp32 ops
    for out in run(2, _gpt2_case, str(tmp_path)):
        assert out["keys"].missing_keys == [] and out["keys"].unexpected_keys == []
        assert torch.equal(out["loss"], out["ref_loss"])
        assert out["n"] == out["ref_n"] > 0
        assert "resize before attach" in out["resize"] and "transformer.wte.weight" in out["resize"]


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


def _resize_model(kind: str):
    torch.manual_seed(0)
    if kind == "llama":  # untied head: a new nn.Linear replaces lm_head
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2, vocab_size=97,
                                       max_position_embeddings=32, tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(cfg)
    return transformers.GPT2LMHeadModel(_config())


def _resize_case(kind: str, where: str, size: dict) -> dict:
    import torch.distributed as dist
    from parts.partition import attach, full_state_dict, meta, partition_module, partitioned
    rank = dist.get_rank()
    ref = _resize_model(kind)
    torch.manual_seed(7)
    ref.resize_token_embeddings(**size)
    with partitioned(enabled=where != "partition_module"):
        model = _resize_model(kind)
        if where == "inside":
            torch.manual_seed(7 + rank)  # each rank draws its own new rows: rank 0's are kept
            model.resize_token_embeddings(**size)
    if where == "partition_module":
        partition_module(model)
    if where != "inside":
        torch.manual_seed(7 + rank)
        model.resize_token_embeddings(**size)
    full, ref_sd = full_state_dict(model, rank0_only=False), ref.state_dict()
    emb = model.get_input_embeddings().weight
    attach(model)
    model.eval(), ref.eval()
    x = torch.arange(ref.config.vocab_size - 16, ref.config.vocab_size).view(2, 8)  # new tokens too
    with torch.no_grad():
        loss, ref_loss = model(input_ids=x, labels=x).loss, ref(input_ids=x, labels=x).loss
    return dict(keys=sorted(full) == sorted(ref_sd), unequal=[k for k in ref_sd if not torch.equal(full[k], ref_sd[k])],
                shape=tuple(meta(emb).shape), ref_shape=tuple(ref.get_input_embeddings().weight.shape),
                vocab=model.config.vocab_size, ref_vocab=ref.config.vocab_size,
                tied=model.get_output_embeddings().weight is emb, ref_tied=ref.get_output_embeddings().weight
                is ref.get_input_embeddings().weight, loss=loss, ref_loss=ref_loss)


@pytest.mark.parametrize("kind,where,size", [
    ("gpt2", "inside", dict(new_num_tokens=103)),  # mean_resizing (HF's default): a sampled normal
    ("gpt2", "outside", dict(new_num_tokens=103)),
    ("gpt2", "partition_module", dict(new_num_tokens=90)),  # shrinking keeps the first 90 rows
    ("llama", "inside", dict(new_num_tokens=100, pad_to_multiple_of=8, mean_resizing=False)),
    ("llama", "partition_module", dict(new_num_tokens=101)),
])
def test_resize_token_embeddings_equals_the_plain_resize(kind, where, size):
    # the same HF code on the same full tensors, new rows drawn with rank 0's RNG state: every
    # weight bitwise equal to the plain model resized with that state, tying kept; the eval
    # loss (fp32, same weights) is bitwise equal too
    for out in run(2, _resize_case, kind, where, size):
        assert out["keys"] and out["unequal"] == [], out["unequal"]
        assert out["shape"] == out["ref_shape"] and out["vocab"] == out["ref_vocab"] == out["ref_shape"][0]
        assert out["tied"] == out["ref_tied"] == (kind == "gpt2")
        assert torch.equal(out["loss"], out["ref_loss"])


def _resize_pretrained_case(folder: str) -> list:
    import torch.distributed as dist
    from parts.partition import full_state_dict, partitioned
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(_config())
    if dist.get_rank() == 0:
        ref.save_pretrained(folder)
    dist.barrier()
    with partitioned():
        model = transformers.GPT2LMHeadModel.from_pretrained(folder)
    torch.manual_seed(7 + dist.get_rank())
    model.resize_token_embeddings(110, mean_resizing=False)
    torch.manual_seed(7)
    ref.resize_token_embeddings(110, mean_resizing=False)
    full, ref_sd = full_state_dict(model, rank0_only=False), ref.state_dict()
    wrong = [k for k in ref_sd if not torch.equal(full[k], ref_sd[k])]
    return wrong + ([] if sorted(full) == sorted(ref_sd) else ["keys"])


def test_resize_after_from_pretrained_inside_partitioned(tmp_path):
    # the model transformers built on meta under partitioned() gets the sharded resize too
    assert run(2, _resize_pretrained_case, str(tmp_path)) == [[], []]


def _resize_on_disk_case(directory: str) -> str:
    import torch.distributed as dist
    from parts.offload import DiskStore
    from parts.partition import partitioned
    store = DiskStore(f"{directory}/rank{dist.get_rank()}")
    try:
        with partitioned(remote_device=store):
            model = transformers.GPT2LMHeadModel(_config())
        with pytest.raises(NotImplementedError) as err:
            model.resize_token_embeddings(100)
        return str(err.value)
    finally:
        store.close()


@pytest.mark.parametrize("world", [2, 3])
def test_resize_with_shards_on_disk_is_refused_on_every_rank(world, tmp_path):
    for message in run(world, _resize_on_disk_case, str(tmp_path)):
        assert "resize_token_embeddings" in message and "has its shard on disk" in message
        assert "wte.weight" in message and "load_full_state_dict" in message
