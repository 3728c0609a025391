"""parts.partition construction: partitioned(), init code, state dicts, memory bound (harness, world 1..4)."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from harness import run
from parts.partition import (ParamStatus, full_state_dict, gather, gathered, is_partitioned,
                             load_full_state_dict, meta, partition_module, partitioned)
from parts.partition.core.param import internal


# --------------------------------------------------------------------- test models
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class GPT(nn.Module):
    """nanoGPT-style: tied head, ``self.apply(self._init_weights)``, scaled c_proj init, numel count."""

    def __init__(self, vocab=37, d=8, n_layer=3):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(16, d)
        self.h = nn.ModuleList([Block(d) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        self.register_buffer("mask", torch.tril(torch.ones(16, 16)) * torch.rand(1))
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        self.n_params = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[-1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class HFStyle(nn.Module):
    """Hugging Face style: ``post_init()`` -> ``init_weights()`` -> ``.data.normal_()``; a reset child."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.layers = nn.ModuleList()
        for _ in range(2):  # a ModuleList built in a loop
            self.layers.append(nn.Linear(6, 6))
        self.conv = nn.Conv1d(6, 4, 3)
        self.conv.reset_parameters()  # re-init a sharded child
        w = self.layers[0].weight.data  # alias taken during construction
        w.mul_(3.0)
        nn.init.orthogonal_(self.layers[1].weight)  # in-place init on a child's weight
        with torch.no_grad():
            self.layers[1].bias.add_(self.embed.weight[0])  # reads another sharded param
        self.post_init()

    def post_init(self):
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=0.5)
            module.weight.data[0].zero_()


MODELS = {"gpt": GPT, "hf": HFStyle}


def _plain_state(name, seed):
    torch.manual_seed(seed)
    model = MODELS[name]()
    return model.state_dict(), torch.get_rng_state()


# --------------------------------------------------------------------- equality with the plain build
def body_build_equals_plain(name, seed):
    rank = dist.get_rank()
    torch.manual_seed(seed + 101 * rank)  # every rank has another seed
    with partitioned():
        model = MODELS[name]()
    rng_after = torch.get_rng_state()
    for p in model.parameters():
        assert is_partitioned(p) and p.data.numel() == 0 and meta(p).status is ParamStatus.NOT_AVAILABLE
    sd = full_state_dict(model, rank0_only=False)
    ref, _ = _plain_state(name, seed)  # rank 0's seed
    assert list(sd) == list(ref), (list(sd), list(ref))
    for k in ref:
        assert torch.equal(sd[k], ref[k]), k
    _, own_rng = _plain_state(name, seed + 101 * rank)
    assert torch.equal(rng_after, own_rng)  # the random stream is unchanged
    return sum(1 for _ in model.parameters())


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_build_equals_plain_build_with_rank0_seed(name, world):
    counts = run(world, body_build_equals_plain, name, 1234)
    assert len(set(counts)) == 1


def body_bf16_build():
    torch.manual_seed(7 + dist.get_rank())
    with partitioned(dtype=torch.bfloat16):
        model = GPT()
    sd = full_state_dict(model, rank0_only=False)
    torch.manual_seed(7)
    ref = GPT()
    params = dict(ref.named_parameters())
    ref_bf16 = ref.to(torch.bfloat16).state_dict()
    # re-init runs in the creation dtype (fp32) and is cast at re-shard: equal to plain-then-cast
    same_params = all(torch.equal(sd[k], ref_bf16[k]) for k in ref_bf16 if k in params)
    buffers_kept = sd["mask"].dtype == torch.float32  # buffers are not converted
    return same_params and buffers_kept and all(sd[k].dtype == torch.bfloat16 for k in params)


def test_bf16_build_equals_plain_build_cast():
    assert all(run(2, body_bf16_build))


def body_gpt_details():
    torch.manual_seed(0)
    ref = GPT()
    torch.manual_seed(dist.get_rank())
    with partitioned():
        model = GPT()
    assert model.lm_head.weight is model.wte.weight
    records = {id(meta(p)) for p in (model.lm_head.weight, model.wte.weight)}
    assert len(records) == 1 and meta(model.wte.weight).name == "wte.weight"  # one record, first name
    ids = [meta(p).id for p in model.parameters()]
    assert model.n_params == ref.n_params  # numel of released params answered from the record
    assert meta(model.h[1].fc.weight).name == "h.1.fc.weight"
    assert torch.equal(model.mask, ref.mask)  # buffers full, rank 0's values
    idx = torch.arange(10).remainder(37).view(2, 5)
    with gathered(model.parameters()):
        out = model(idx)
    assert torch.equal(out, ref(idx))
    return ids


def test_gpt_tied_weights_ids_buffers_forward():
    ids = run(3, body_gpt_details)
    assert ids[0] == ids[1] == ids[2] and len(set(ids[0])) == len(ids[0])


# --------------------------------------------------------------------- context features
class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        with partitioned(dtype=torch.bfloat16):  # a nested context with its own dtype
            self.inner = nn.Linear(3, 5)
        with partitioned(enabled=False):
            self.plain = nn.Linear(2, 2)
        self.outer = nn.Linear(5, 3)


def body_context_features():
    with partitioned():
        h = Holder()
        h.late = nn.Parameter(torch.ones(7))  # attribute assignment after __init__
        h.outer.register_parameter("extra", nn.Parameter(torch.ones(2, 2)))
        bare = nn.Module()
        bare.w = nn.Parameter(torch.zeros(3))

        class Defined(nn.Module):  # a class defined inside the context
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.ones(5))
        d = Defined()
    after = nn.Linear(2, 2)
    h.after = nn.Parameter(torch.ones(2))  # outside the context: left alone
    assert meta(h.inner.weight).dtype == torch.bfloat16 and h.inner.weight.dtype == torch.bfloat16
    assert meta(h.outer.weight).dtype == torch.float32
    assert not is_partitioned(h.plain.weight) and h.plain.weight.shape == (2, 2)
    assert meta(h.late).name == "late" and meta(h.outer.extra).name == "outer.extra"
    assert is_partitioned(bare.w) and is_partitioned(d.w)
    assert not is_partitioned(after.weight) and not is_partitioned(h.after)
    assert not getattr(nn.Linear.__init__, "_parts_wrapped", False)
    assert "apply" not in vars(nn.Module) or nn.Module.apply.__module__ == "torch.nn.modules.module"
    assert torch._C._len_torch_function_stack() == 0
    with gathered([h.late, d.w]):
        return torch.equal(h.late.data, torch.ones(7)) and torch.equal(d.w.data, torch.ones(5))


def test_nested_contexts_late_params_no_leak():
    assert all(run(2, body_context_features))


def _decorated(cls: type) -> type:
    """Wrap ``cls.__init__`` once the class exists, as Hugging Face kernels'
    ``use_kernelized_func`` does: each instance gets an attribute its forward needs."""
    orig = cls.__init__

    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        self.__dict__["decorated"] = True
    cls.__init__ = __init__
    return cls


def body_decorated_inside_the_context():
    with partitioned():
        @_decorated
        class Lazy(nn.Module):  # defined inside the context, as a lazily imported model class is
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.ones(3))
        inside = Lazy()
    after = Lazy()
    with partitioned():
        again = Lazy()
    built = [inside, after, again]
    return ([m.__dict__.get("decorated", False) for m in built], [is_partitioned(m.w) for m in built])


def test_a_class_decorated_after_its_definition_inside_the_context_keeps_its_decoration():
    for decorated, sharded in run(2, body_decorated_inside_the_context):
        assert decorated == [True, True, True] and sharded == [True, False, True]


def body_no_leak_after_error():
    try:
        with partitioned():
            nn.Linear(2, 2)
            raise KeyError("boom")
    except KeyError:
        pass
    plain = nn.Linear(2, 2)
    with partitioned(enabled=False):
        off = nn.Linear(2, 2)
    return (not is_partitioned(plain.weight) and not is_partitioned(off.weight)
            and torch._C._len_torch_function_stack() == 0)


def test_no_leak_after_exception_and_enabled_false():
    assert all(run(2, body_no_leak_after_error))


def body_remote_device():
    with partitioned(device="cpu", remote_device="cpu", pin_memory=True):
        lin = nn.Linear(4, 3)
    m = meta(lin.weight)
    gather([lin.weight])
    return m.shard.device.type == "cpu" and lin.weight.shape == (3, 4)


def test_device_and_remote_device():
    assert all(run(2, body_remote_device))


# --------------------------------------------------------------------- state dicts
def body_state_dicts():
    rank = dist.get_rank()
    torch.manual_seed(5)
    model = partition_module(GPT())
    sd = full_state_dict(model)  # rank 0 only
    assert (sd == {}) == (rank != 0)
    plain = GPT()
    if rank == 0:
        plain.load_state_dict(sd)  # a sharded save loads into a plain model
    new = {k: torch.full_like(v, 0.5) if v.is_floating_point() else v for k, v in plain.state_dict().items()}
    load_full_state_dict(model, new if rank == 0 else {})  # and the other way round
    back = full_state_dict(model, rank0_only=False)
    ok = all(torch.equal(back[k], new[k]) for k in new)
    bad = dict(new)
    bad["h.0.fc.weight"] = torch.zeros(3, 3)
    try:
        load_full_state_dict(model, bad)
        ok = False
    except RuntimeError as e:
        ok = ok and "'h.0.fc.weight'" in str(e)
    missing = dict(new)
    del missing["ln_f.bias"]
    try:
        load_full_state_dict(model, missing)
        ok = False
    except RuntimeError as e:
        ok = ok and "ln_f.bias" in str(e)
    result = load_full_state_dict(model, missing, strict=False)
    return ok and result.missing_keys == ["ln_f.bias"]


def test_full_state_dict_roundtrip_and_errors():
    assert all(run(2, body_state_dicts))


# --------------------------------------------------------------------- memory bound
class Layer(nn.Linear):
    """Linear(1024, 1024) that samples the parameter storage held when its constructor ends."""

    live: list = []
    samples: list = []

    def __init__(self):
        super().__init__(1024, 1024)
        Layer.live.append(self)
        with internal:  # count storages without triggering a gather
            Layer.samples.append(_param_bytes(Layer.live))


def _param_bytes(layers):
    total = 0
    for layer in layers:
        for p in layer.parameters():
            total += p.untyped_storage().nbytes()
            if is_partitioned(p):
                total += meta(p).shard.untyped_storage().nbytes()
    return total


def body_memory(n_layers):
    Layer.live, Layer.samples = [], []
    with partitioned():
        stack = nn.Sequential(*[Layer() for _ in range(n_layers)])
    final = _param_bytes(Layer.live)
    Layer.live = []
    layer_bytes = sum(p.numel() for p in nn.Linear(1024, 1024).parameters()) * 4
    return max(Layer.samples + [final]), final, layer_bytes, len(stack)


def test_construction_peak_at_most_half_model_plus_one_layer():
    for peak, final, layer, n in run(2, body_memory, 78):
        model = n * layer
        assert final <= model / 2 + 64 * n  # shards only (plus padding)
        assert peak <= model / 2 + layer, (peak, model)
