"""``generating(model)``: generate() on a sharded HF model equals the unsharded model's, whether
the model is gathered once or streamed within a budget, and training after it is unchanged."""

import pytest
import torch

from harness import run

transformers = pytest.importorskip("transformers")

VOCAB = 61


def _gpt2() -> "torch.nn.Module":
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def _llama() -> "torch.nn.Module":
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


_BUILD = {"gpt2": _gpt2, "llama": _llama}


def _pair(kind: str, **knobs) -> tuple:
    """A sharded attached model and an unsharded one holding the same weights."""
    from parts.partition import attach, full_state_dict, partitioned
    torch.manual_seed(0)
    with partitioned():
        model = _BUILD[kind]()
    coordinator = attach(model, **knobs)
    torch.manual_seed(0)
    plain = _BUILD[kind]()
    plain.load_state_dict(full_state_dict(model, rank0_only=False))
    return model.eval(), plain.eval(), coordinator


def _prompt(rank: int, length: int = 5) -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, length), generator=torch.Generator().manual_seed(10 + rank))


def _ways(model: torch.nn.Module, prompt: torch.Tensor) -> dict:
    """Greedy, sampled (seeded) and beam-search tokens of ``model``."""
    out = {"greedy": model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)}
    torch.manual_seed(7)
    out["sample"] = model.generate(prompt, max_new_tokens=8, do_sample=True, top_k=5, pad_token_id=0)
    out["beam"] = model.generate(prompt, max_new_tokens=6, num_beams=2, do_sample=False, pad_token_id=0)
    return out


def _gathered_case(kind: str) -> dict:
    import torch.distributed as dist
    from parts.partition import generating
    model, plain, coordinator = _pair(kind)
    prompt = _prompt(dist.get_rank())
    before = coordinator.stats()
    with generating(model) as mode:
        got = _ways(model, prompt)
    return dict(mode=mode, got=got, ref=_ways(plain, prompt), no_step=coordinator.stats() is before)


@pytest.mark.parametrize("kind,world", [("gpt2", 2), ("llama", 3)])
def test_generate_gathered_once_equals_the_unsharded_model(kind, world):
    for out in run(world, _gathered_case, kind, timeout=120):
        assert out["mode"] == "gathered" and out["no_step"]  # no forward was a coordinator step
        for way, tokens in out["ref"].items():
            assert torch.equal(out["got"][way], tokens), way


def _resident_bytes(model: torch.nn.Module) -> int:
    from parts.partition import ParamStatus, is_partitioned, meta
    return sum(p.numel() * p.element_size() for p in dict.fromkeys(model.parameters())
               if is_partitioned(p) and meta(p).status is not ParamStatus.NOT_AVAILABLE)


def _streamed_case(kind: str) -> dict:
    import torch.distributed as dist
    from parts.partition import generating
    model, plain, coordinator = _pair(kind, persistence_threshold=0, fetch_unit_size=0, prefetch_bucket_size=4000)
    whole = sum(p.numel() * 4 for p in plain.parameters())
    budget = whole // 2
    peak = [0]

    def probe(*_):
        peak[0] = max(peak[0], _resident_bytes(model))

    handles = [m.register_forward_hook(probe) for m in model.modules()]
    rank = dist.get_rank()
    prompt = _prompt(rank, length=3 + 4 * rank)  # uneven lengths and lengths of output per rank
    new = 4 + 5 * rank
    with generating(model, memory_budget=budget) as mode:
        got = model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
        streamed = coordinator.stats().allgather_bytes  # the last decoding step's
    for h in handles:
        h.remove()
    model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0, synced_gpus=True)
    ref = plain.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    return dict(mode=mode, same=torch.equal(got, ref), peak=peak[0], budget=budget, whole=whole,
                streamed=streamed, every_layer=coordinator.stats().allgather_bytes)


@pytest.mark.parametrize("kind,world", [("gpt2", 2), ("llama", 3)])
def test_generate_streamed_within_a_budget_equals_the_unsharded_model(kind, world):
    for out in run(world, _streamed_case, kind, timeout=120):
        assert out["mode"] == "streamed" and out["same"]
        assert 0 < out["peak"] <= out["budget"] < out["whole"]
        # what fits the budget stays gathered between decoding steps: each gathers less than all
        assert 0 < out["streamed"] < out["every_layer"]


def _train(model: torch.nn.Module, optimizer, steps: int, rank: int) -> list:
    losses = []
    for i in range(steps):
        x = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(100 * i + rank))
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def _training_case(generate: bool, mixed: bool, default_knobs: bool = False) -> dict:
    import torch.distributed as dist
    from parts.partition import MixedPrecision, full_state_dict, generating, shards
    knobs = {} if default_knobs else dict(persistence_threshold=0, fetch_unit_size=0)
    if mixed:
        knobs["mixed_precision"] = MixedPrecision()
    model, plain, coordinator = _pair("gpt2", **knobs)
    model.train()
    optimizer = torch.optim.AdamW(shards(model), lr=1e-2)
    rank = dist.get_rank()
    losses = _train(model, optimizer, 2, rank)
    tokens = {}
    if generate:
        model.eval()
        budget = sum(p.numel() * 4 for p in plain.parameters()) // 4  # below the bf16 model too
        limits = (None,) if default_knobs else (None, budget)  # defaults: all persistent, one unit
        for limit in limits:
            with generating(model, memory_budget=limit) as mode:
                tokens[mode] = model.generate(_prompt(rank), max_new_tokens=6, do_sample=False, pad_token_id=0)
        model.train()
        if mixed:  # the unsharded model in bf16 with the same (stepped) weights
            plain.load_state_dict(full_state_dict(model, rank0_only=False))
            plain.to(torch.bfloat16).eval()
            tokens["plain"] = plain.generate(_prompt(rank), max_new_tokens=6, do_sample=False, pad_token_id=0)
    losses += _train(model, optimizer, 2, rank)
    stats = coordinator.stats()
    return dict(losses=torch.stack(losses), digest=stats.trace_digest, tokens=tokens,
                state=full_state_dict(model, rank0_only=False))


@pytest.mark.parametrize("mixed,default_knobs", [(False, False), (True, False), (True, True)])
def test_training_after_generation_equals_training_without_it(mixed, default_knobs):
    # default knobs: the small model's parameters are persistent (and flat), gathered between steps
    with_it = run(2, _training_case, True, mixed, default_knobs, timeout=120)
    without = run(2, _training_case, False, mixed, default_knobs, timeout=120)
    for a, b in zip(with_it, without):
        assert torch.equal(a["losses"], b["losses"]) and a["digest"] == b["digest"]
        assert a["state"].keys() == b["state"].keys()
        assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])
        # the same bf16 (or fp32) weights whether gathered once or streamed: the same tokens
        assert default_knobs or torch.equal(a["tokens"]["gathered"], a["tokens"]["streamed"])
        assert not mixed or torch.equal(a["tokens"]["gathered"], a["tokens"]["plain"])


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    import warnings
    import peft
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], init_lora_weights="gaussian",
                             fan_in_fan_out=True, lora_dropout=0.0)
    with warnings.catch_warnings():  # peft reads a transformers attribute deprecated in its favour
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return peft.get_peft_model(model, config)


def _variant_case(variant: str, tmp: str) -> dict:
    """LoRA adapters (peft) or shards on disk (DiskStore): gathered and streamed tokens equal the plain model's."""
    import torch.distributed as dist
    from parts.offload import DiskStore
    from parts.partition import attach, full_state_dict, generating, partitioned
    rank = dist.get_rank()
    remote = DiskStore(f"{tmp}/r{rank}") if variant == "disk" else None
    wrap = _lora if variant == "lora" else (lambda m: m)
    torch.manual_seed(0)
    with partitioned(remote_device=remote):
        model = wrap(_gpt2())
    attach(model, persistence_threshold=0, fetch_unit_size=0)
    torch.manual_seed(0)
    plain = wrap(_gpt2())
    plain.load_state_dict(full_state_dict(model, rank0_only=False))
    model.eval(), plain.eval()
    prompt = _prompt(rank)
    budget = sum(p.numel() * 4 for p in plain.parameters()) // 2
    got = {}
    for limit in (None, budget):
        with generating(model, memory_budget=limit) as mode:
            got[mode] = model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    ref = plain.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    if remote is not None:
        remote.close()
    return dict(modes=sorted(got), same=all(torch.equal(t, ref) for t in got.values()))


@pytest.mark.parametrize("variant", ["lora", "disk"])
def test_generate_with_lora_adapters_or_shards_on_disk(variant, tmp_path):
    if variant == "lora":
        pytest.importorskip("peft")
    for out in run(2, _variant_case, variant, str(tmp_path), timeout=120):
        assert out["modes"] == ["gathered", "streamed"] and out["same"]


def _unattached_and_errors_case() -> dict:
    import torch.distributed as dist
    from parts.partition import attach, full_state_dict, generating, partitioned
    torch.manual_seed(0)
    with partitioned():
        model = _gpt2().eval()
    plain = _gpt2().eval()
    plain.load_state_dict(full_state_dict(model, rank0_only=False))
    prompt = _prompt(dist.get_rank())
    with generating(model) as mode:  # sharded, never attached: gathered for the block
        got = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    ref = plain.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    attach(model)  # defaults: the whole small model is one fetch unit
    errors = []
    for budget in (1000, -1):
        try:
            with generating(model, memory_budget=budget):
                pass
        except ValueError as error:
            errors.append(str(error))
    return dict(mode=mode, same=torch.equal(got, ref), errors=errors)


def test_unattached_model_is_gathered_and_a_budget_below_one_unit_is_refused():
    for out in run(2, _unattached_and_errors_case, timeout=120):
        assert out["mode"] == "gathered" and out["same"]
        assert "largest fetch unit" in out["errors"][0] and "memory_budget=1000" in out["errors"][0]
        assert "memory_budget must be a number of bytes" in out["errors"][1]


def test_keep_plan_leaves_room_for_the_largest_streamed_unit():
    from parts.partition.coordinator.generating import keep_plan
    sizes = {0: 100, 1: 30, 2: 30, 3: 5, 4: 5, 5: 1}
    units = [[0], [1, 3], [2, 4], [5]]
    for budget in range(0, 200, 7):
        kept = keep_plan(sizes, units, frozenset({5}), budget)
        streamed = max(sum(sizes[p] for p in u if p not in kept and p != 5) for u in units)
        assert 5 not in kept and sum(sizes[p] for p in kept) + streamed <= max(budget, streamed)
    assert keep_plan(sizes, units, frozenset({5}), 135) == frozenset({0})  # 100 kept + 35 streamed
    assert keep_plan(sizes, units, frozenset({5}), 99) == frozenset()


def _hybrid_case() -> dict:
    """2 replicas x 2 shards (a DeviceMesh, as FSDP2 takes it): both ways equal the plain model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from parts.partition import attach, full_state_dict, generating, partitioned
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    with partitioned(mesh=mesh):
        model = _gpt2().eval()
    attach(model, persistence_threshold=0, fetch_unit_size=0)
    plain = _gpt2().eval()
    plain.load_state_dict(full_state_dict(model, rank0_only=False))
    prompt = _prompt(dist.get_rank(), length=3 + dist.get_rank())
    budget = sum(p.numel() * 4 for p in plain.parameters()) // 2
    got = {}
    for limit in (None, budget):
        with generating(model, memory_budget=limit) as mode:
            got[mode] = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    ref = plain.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    return dict(modes=sorted(got), same=all(torch.equal(t, ref) for t in got.values()))


def test_generate_on_a_hybrid_layout_equals_the_unsharded_model():
    for out in run(4, _hybrid_case, timeout=120):
        assert out["modes"] == ["gathered", "streamed"] and out["same"]
