"""Frozen parameters and LoRA with the default coordinator knobs: tiny Hugging Face Llama and GPT-2
train with the losses of plain torch, frozen params reduce and hold nothing; skipped without
transformers / peft (parts[hf])."""

import copy
import warnings

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from harness import run

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# 3200 x 32 embeddings (and Llama's lm_head) are over the default persistence threshold (100_000
# elements): they are gathered per use and reduce-scattered one by one, every other param of these
# tiny models is persistent (gathered for good, its grads reduce-scattered in one flat collective)
STEPS, ROWS, SEQ, VOCAB = 3, 2, 8, 3200
# Plain torch sums each grad over the whole batch in one op; the sharded model sums each rank's
# half and then the halves: fp32 rounding differs in the last bits, the losses stay within 1e-6.
TOL = dict(rtol=0, atol=1e-6)


def _llama() -> "transformers.PreTrainedModel":
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def _gpt2() -> "transformers.PreTrainedModel":
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


BUILD = {"llama": _llama, "gpt2": _gpt2}


def _freeze(model, what: str) -> None:
    """Freeze one part of a tiny Llama or GPT-2 (``what``: embed, norm, layer, none)."""
    core = model.model if hasattr(model, "model") else model.transformer
    if what == "embed":  # GPT-2's is tied to lm_head: the tied weight is frozen for both
        core.get_input_embeddings().weight.requires_grad_(False)
    elif what == "norm":
        (core.norm if hasattr(core, "norm") else core.ln_f).requires_grad_(False)
    elif what == "layer":
        (core.layers if hasattr(core, "layers") else core.h)[0].requires_grad_(False)


def _lora(model, save: tuple = ()):
    """LoRA on the attention projections (r=4, B initialised non-zero so step 1 already moves it);
    ``save``: modules peft copies and trains whole (``modules_to_save``)."""
    targets = ["q_proj", "v_proj"] if hasattr(model, "model") else ["c_attn"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights="gaussian",
                             fan_in_fan_out=not hasattr(model, "model"), lora_dropout=0.0,
                             modules_to_save=list(save) or None)
    with warnings.catch_warnings():  # peft reads a transformers attribute deprecated in its favour
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return peft.get_peft_model(model, config)


def _batches(world: int) -> list:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (ROWS * world, SEQ), generator=gen) for _ in range(STEPS)]


def _plain_losses(ref, batches: list, world: int, toggle=None) -> list:
    """Plain torch on the whole batch: the mean of the per-rank halves' losses, each half's kept."""
    opt = torch.optim.AdamW([p for p in ref.parameters()], lr=1e-2)
    out = []
    for step, x in enumerate(batches):
        if toggle is not None:
            toggle(ref, step)
        halves = [ref(input_ids=h, labels=h).loss for h in x.split(ROWS)]
        torch.stack(halves).mean().backward()
        opt.step()
        opt.zero_grad()
        out.append([h.item() for h in halves])
    return out


def _sharded_losses(model, co, batches: list, toggle=None) -> tuple:
    """Train the attached model on this rank's rows; losses and the reduce-scattered bytes per step."""
    import torch.distributed as dist
    from parts.partition import shards
    rank = dist.get_rank()
    opt = torch.optim.AdamW(shards(model), lr=1e-2)
    losses, reduced = [], []
    for step, x in enumerate(batches):
        if toggle is not None:
            toggle(model, step)
        mine = x[rank * ROWS:(rank + 1) * ROWS]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        reduced.append(co.stats().reduce_scatter_bytes)
    return losses, reduced


def _frozen_case(arch: str, what: str) -> dict:
    import torch.distributed as dist
    from parts.partition import attach, meta, partition_module
    world = dist.get_world_size()
    torch.manual_seed(0)
    ref = BUILD[arch]()
    model = partition_module(copy.deepcopy(ref))
    _freeze(ref, what)
    if what == "norm":  # frozen after attach: the coordinator reads requires_grad at each backward
        co = attach(model)
        _freeze(model, what)
    else:
        _freeze(model, what)
        co = attach(model)
    batches = _batches(world)
    plain = _plain_losses(ref, batches, world)
    losses, reduced = _sharded_losses(model, co, batches)
    frozen = [meta(p) for p in model.parameters() if not p.requires_grad]
    trainable = sum(meta(p).layout.shard_numel for p in model.parameters() if p.requires_grad)
    return dict(plain=[s[dist.get_rank()] for s in plain], losses=losses, reduced=reduced,
                frozen=len(frozen), frozen_grads=[m.grad_shard for m in frozen if m.grad_shard is not None],
                trainable_bytes=(world - 1) * trainable * 4)


CASES = [("llama", "embed"), ("llama", "norm"), ("llama", "layer"), ("llama", "none"),
         ("gpt2", "embed"), ("gpt2", "norm"), ("gpt2", "layer")]


@pytest.mark.parametrize("arch,what", CASES)
def test_frozen_parts_train_like_plain_torch_with_default_knobs(arch, what):
    # frozen embedding (GPT-2's tied to lm_head), final norm (frozen after attach), a whole layer:
    # the per-rank losses equal plain torch's on the same rows; frozen params get no grad shard and
    # the bytes reduce-scattered per step are those of the trainable params' grad shards exactly
    for out in run(2, _frozen_case, arch, what, timeout=120):
        torch.testing.assert_close(out["losses"], out["plain"], **TOL)
        assert (out["frozen"] > 0) == (what != "none")
        assert out["frozen_grads"] == []
        assert out["reduced"] == [out["trainable_bytes"]] * STEPS


def _toggle_case(arch: str) -> dict:
    import torch.distributed as dist
    from parts.partition import attach, partition_module
    world = dist.get_world_size()
    torch.manual_seed(0)
    ref = BUILD[arch]()
    model = partition_module(copy.deepcopy(ref))
    co = attach(model)

    def toggle(m, step: int) -> None:  # frozen at step 1, trainable again at step 2
        core = m.model if hasattr(m, "model") else m.transformer
        frozen = step == 1
        core.get_input_embeddings().requires_grad_(not frozen)  # tied to lm_head for GPT-2
        (core.layers if hasattr(core, "layers") else core.h)[1].requires_grad_(not frozen)
        (core.norm if hasattr(core, "norm") else core.ln_f).requires_grad_(not frozen)

    batches = _batches(world)
    plain = _plain_losses(ref, batches, world, toggle)
    losses, reduced = _sharded_losses(model, co, batches, toggle)
    return dict(plain=[s[dist.get_rank()] for s in plain], losses=losses, reduced=reduced)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_requires_grad_toggled_between_steps(arch):
    # the flat persistent params' one reduce-scatter follows the flags at each backward: the step
    # with frozen parts reduce-scatters fewer bytes, and the losses stay plain torch's
    for out in run(2, _toggle_case, arch, timeout=120):
        torch.testing.assert_close(out["losses"], out["plain"], **TOL)
        assert out["reduced"][1] < out["reduced"][0] == out["reduced"][2]


def _lora_case(arch: str, how: str) -> dict:
    import torch.distributed as dist
    from parts.partition import attach, load_full_state_dict, meta, partition_module, partitioned
    world = dist.get_world_size()
    torch.manual_seed(0)
    save = ("lm_head",) if how == "sharded base" else ()
    ref = _lora(BUILD[arch](), save)
    if how == "inside":  # get_peft_model inside partitioned(): the adapters are sharded as built
        with partitioned():
            model = _lora(BUILD[arch]())
        load_full_state_dict(model, ref.state_dict())
    elif how == "sharded base":  # on a model sharded before; peft deep-copies the sharded lm_head
        with partitioned():
            base = BUILD[arch]()
        with partitioned():
            model = _lora(base, save)
        load_full_state_dict(model, ref.state_dict())
    else:  # get_peft_model on the plain model, sharded after
        model = partition_module(copy.deepcopy(ref))
    co = attach(model)
    batches = _batches(world)
    plain = _plain_losses(ref, batches, world)
    losses, reduced = _sharded_losses(model, co, batches)
    lora = [meta(p) for n, p in model.named_parameters() if "lora_" in n or "modules_to_save" in n]
    trainable = [meta(p) for p in model.parameters() if p.requires_grad]
    return dict(plain=[s[dist.get_rank()] for s in plain], losses=losses, reduced=reduced,
                lora_is_trainable=len(lora) == len(trainable) > 0,
                frozen_grads=sum(meta(p).grad_shard is not None for p in model.parameters()
                                 if not p.requires_grad),
                trainable_bytes=(world - 1) * 4 * sum(m.layout.shard_numel for m in trainable))


@pytest.mark.parametrize("arch,how", [("llama", "inside"), ("llama", "after"), ("llama", "sharded base"),
                                      ("gpt2", "inside")])
def test_peft_lora_trains_like_plain_torch(arch, how):
    for out in run(2, _lora_case, arch, how, timeout=120):
        torch.testing.assert_close(out["losses"], out["plain"], **TOL)
        assert out["lora_is_trainable"] and out["frozen_grads"] == 0
        assert out["reduced"] == [out["trainable_bytes"]] * STEPS


def test_frozen_layer_world_3():
    # the mean over 3 ranks rounds differently from plain torch's over the whole batch: a few fp32
    # ulps of the loss after two AdamW steps, the same with nothing frozen or every param per-parameter
    for out in run(3, _frozen_case, "llama", "layer", timeout=120):
        torch.testing.assert_close(out["losses"], out["plain"], rtol=1e-6, atol=0)
        assert out["reduced"] == [out["trainable_bytes"]] * STEPS


def _disagree_case(what: str) -> str:
    import torch.distributed as dist
    from parts.partition import RankDivergence, attach, partition_module
    torch.manual_seed(0)
    model = partition_module(_llama())
    co = attach(model, debug=True)
    if dist.get_rank() == 1:
        _freeze(model, what)
    x = _batches(dist.get_world_size())[0][:ROWS]
    try:
        model(input_ids=x, labels=x).loss.backward()
    except (RankDivergence, ValueError) as err:
        return str(err)
    finally:
        co.detach()
    return "no error"


def test_debug_names_a_parameter_frozen_on_one_rank_only():
    # frozen on rank 1 only, a persistent norm (the one flat reduce-scatter would differ in size)
    # or the embedding (reduce-scattered on its own): the backward's check of requires_grad (debug
    # or not) raises on every rank before the collective, naming the parameter
    for what, name in (("norm", "model.norm.weight"), ("embed", "model.embed_tokens.weight")):
        for message in run(2, _disagree_case, what, timeout=60):
            assert f"requires_grad of parameter '{name}'" in message and "False on [1]" in message


def _adapters_after_case() -> dict:
    """Full fine-tuning of a sharded, attached Llama for a step, then LoRA added to it: detach,
    get_peft_model, partition_module (shards the new adapters only), attach; two LoRA steps."""
    import torch.distributed as dist
    from parts.partition import attach, load_full_state_dict, meta, partitioned, partition_module
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = _llama()
    with partitioned():
        model = _llama()
    load_full_state_dict(model, ref.state_dict())
    first, *later = _batches(world)
    plain = _plain_losses(ref, [first], world)
    co = attach(model)
    losses, _ = _sharded_losses(model, co, [first])
    torch.manual_seed(1)
    ref = _lora(ref)
    torch.manual_seed(1)
    model = partition_module(_lora(model))  # the adapters are new: only they get sharded
    try:
        attach(model)
        refused = ""
    except RuntimeError as err:  # the base model inside is still attached
        refused = str(err)
    co.detach()
    co = attach(model)
    plain += _plain_losses(ref, later, world)
    more, reduced = _sharded_losses(model, co, later)
    return dict(plain=[s[rank] for s in plain], losses=losses + more, refused=refused,
                adapters=sum(n.count("lora_") for n, p in model.named_parameters() if p.requires_grad),
                reduced=reduced, trainable_bytes=(world - 1) * 4 * sum(
                    meta(p).layout.shard_numel for p in model.parameters() if p.requires_grad))


def test_adapters_added_to_a_sharded_trained_model():
    for out in run(2, _adapters_after_case, timeout=120):
        torch.testing.assert_close(out["losses"], out["plain"], **TOL)
        assert out["adapters"] == 8  # A and B of q_proj and v_proj in 2 layers
        assert out["reduced"] == [out["trainable_bytes"]] * (STEPS - 1)
        assert "'base_model.model' (LlamaForCausalLM)" in out["refused"] and "detach()" in out["refused"]


def _lora_memory_case(what: str) -> dict:
    """A Llama whose MLP weights (128 x 4096) are over the persistence threshold and whose layers
    are fetch units of their own (6.3M elements in all): one step, full fine-tuning or LoRA."""
    from parts.partition import attach, partition_module
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=4096,
                                      num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    model = partition_module(_lora(model) if what == "lora" else model)
    co = attach(model)
    x = _batches(2)[0][:ROWS]
    model(input_ids=x, labels=x).loss.backward()
    return dict(high=co.stats().live_high_water, layer=3 * 128 * 4096)


def test_frozen_params_leave_when_their_units_backward_is_over():
    # frozen base weights are gathered for their layer's backward (the input grads need them) and
    # released when it is over: LoRA holds at most two layers' MLPs (the next layer is fetched as
    # the previous is done), as full fine-tuning holds one, never the 4 of the whole model
    full, lora = run(2, _lora_memory_case, "full")[0], run(2, _lora_memory_case, "lora")[0]
    assert full["high"] == full["layer"]
    assert lora["high"] == 2 * lora["layer"]


def _masks_case(threshold: int, masks: list, ckpt: object) -> dict:
    """The tied-embedding GPT of the coordinator tests, ``masks[step][k]``: parameter k trainable;
    ``ckpt``: its blocks under torch's activation checkpointing (True, "reentrant") or not."""
    import torch.distributed as dist
    from parts.partition import attach, meta, shards
    from test_coordinator_models import GPT, batch, make_pair
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = make_pair(GPT, ckpt=ckpt)
    co = attach(model, persistence_threshold=threshold)
    opts = [torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(shards(model), lr=1e-2)]
    plain, losses, reduced, expected = [], [], [], []
    for step, mask in enumerate(masks):
        for m in (ref, model):
            for p, trainable in zip(m.parameters(), mask):
                p.requires_grad_(trainable)
        halves = [ref(*batch(step, 2, 2 * r)) for r in range(world)]
        torch.stack(halves).mean().backward()
        loss = model(*batch(step, 2, 2 * rank))
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        plain.append(halves[rank].item())
        losses.append(loss.item())
        reduced.append(co.stats().reduce_scatter_bytes)
        expected.append((world - 1) * 4 * sum(meta(p).layout.shard_numel
                                              for p in model.parameters() if p.requires_grad))
    return dict(plain=plain, losses=losses, reduced=reduced, expected=expected)


@settings(max_examples=12, deadline=None)
@given(threshold=st.sampled_from([0, 1_000, 100_000]), ckpt=st.sampled_from([False, True, "reentrant"]),
       masks=st.lists(st.lists(st.booleans(), min_size=37, max_size=37).filter(any), min_size=3, max_size=3))
def test_any_frozen_set_toggled_at_any_step(threshold, ckpt, masks):
    # any parameters frozen at each step (the tied embedding too), with every param per-use (0),
    # norms and biases persistent (1_000) or all persistent (the default), blocks checkpointed or
    # not: plain torch's losses, and exactly the trainable params' grad shards reduce-scattered
    if ckpt == "reentrant":  # torch's reentrant checkpoint needs an input requiring grad: wte or wpe
        assume(all(mask[0] or mask[1] for mask in masks))
    for out in run(2, _masks_case, threshold, masks, ckpt, timeout=60):  # losses up to 14: a few ulps
        torch.testing.assert_close(out["losses"], out["plain"], rtol=1e-6, atol=1e-6)
        assert out["reduced"] == out["expected"]


def _mixed_precision_case(threshold: int, what: str) -> tuple:
    from parts.partition import MixedPrecision, attach, partition_module
    torch.manual_seed(0)
    model = _llama()
    model = partition_module(_lora(model) if what == "lora" else model)
    _freeze(model, "none" if what == "lora" else what)
    co = attach(model, persistence_threshold=threshold, mixed_precision=MixedPrecision())
    return _sharded_losses(model, co, _batches(2))


@pytest.mark.parametrize("what", ["lora", "embed"])
def test_frozen_with_bf16_compute_equals_the_per_parameter_path(what):
    # bf16 gathers and grads, fp32 reduce: the default knobs (frozen params outside the one flat
    # reduce-scatter) give bitwise the losses and bytes of every param gathered and reduced per use
    flat, per_use = run(2, _mixed_precision_case, 100_000, what), run(2, _mixed_precision_case, 0, what)
    assert flat == per_use
