"""parts.plan: meta construction, materialize, and plans that equal what the code does.

The estimate (arithmetic, no process group) equals the dry run (the real coordinator on a
fake world, built on meta) byte for byte across models, world sizes and knobs; the dry run
equals a real gloo run's counters at world 2 and 4; the model-state bytes equal the ZeRO
formulas where no shard is padded.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

from harness import run
from parts.partition.coordinator.plan import Knobs
from parts.plan import Widths, dry_run, estimate, measure, shape_of

_BYTES = ("param_bytes", "grad_bytes", "optimizer_bytes", "persistent_bytes", "gathered_peak_bytes",
          "allgather_bytes", "reduce_scatter_bytes", "all_reduce_bytes", "params", "world_size", "shard_size")


class Block(nn.Module):
    """A pre-norm MLP block: a LayerNorm and two Linears (nested units when it is small)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    """Embedding, blocks, a final norm and a head: a language model's shape without attention."""

    def __init__(self, vocab: int, width: int, hiddens: tuple) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, h) for h in hiddens)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _step(model: nn.Module, device: torch.device) -> torch.Tensor:
    ids = torch.randint(0, model.embed.num_embeddings, (2, 8), device=device)
    return model(input_ids=ids, labels=ids)


def _builder(vocab: int, width: int, hiddens: tuple):
    return lambda: Net(vocab, width, hiddens)


def _fields(plan) -> dict:
    return {k: v for k, v in asdict(plan).items() if k in _BYTES}


knob_sets = st.fixed_dictionaries({
    "persistence_threshold": st.sampled_from([0, 100, 1_000, 100_000]),
    "max_reuse_distance": st.sampled_from([0, 500, 5_000, 5_000_000]),
    "prefetch_bucket_size": st.sampled_from([0, 300, 3_000, 5_000_000]),
    "fetch_unit_size": st.sampled_from([0, 2_000, 5_000_000]),
    "max_live_parameters": st.sampled_from([1_500, 6_000, 1_000_000_000]),
})


layouts = st.sampled_from([(1, None), (2, None), (3, None), (8, None), (64, None), (1024, None),
                           (4, 2), (8, 4), (8, 1), (64, 8), (1024, 8)])  # (world, shard size of a hybrid)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vocab=st.integers(5, 60), width=st.integers(1, 24), hiddens=st.lists(st.integers(1, 40), max_size=3),
       layout=layouts, knobs=knob_sets)
def test_estimate_equals_dry_run(vocab: int, width: int, hiddens: list, layout: tuple, knobs: dict) -> None:
    from parts.partition import partitioned

    build, (world, shard_size) = _builder(vocab, width, tuple(hiddens)), layout
    with partitioned(device="meta"):  # one rank, no process group: ids in creation order
        shape = shape_of(build())
    expected = _fields(dry_run(build, world, step=_step, shard_size=shard_size, **knobs))
    assert _fields(estimate(shape, world, Knobs(**knobs), shard_size=shard_size)) == expected


def test_estimate_equals_dry_run_hf_llama_and_tied_gpt2() -> None:
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    gpt2 = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=300, n_positions=32,
                                   bos_token_id=0, eos_token_id=0)
    for build in (lambda: transformers.LlamaForCausalLM(llama), lambda: transformers.GPT2LMHeadModel(gpt2)):
        with torch.device("meta"):
            shape = shape_of(build())
        for knobs in ({}, {"persistence_threshold": 0, "fetch_unit_size": 0, "max_reuse_distance": 1_000}):
            assert _fields(estimate(shape, 8, Knobs(**knobs))) == _fields(dry_run(build, 8, **knobs))


def test_estimate_sees_reads_declared_on_the_shape() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
    from gpt_model import GPT, GPTConfig  # ties its head by reading wte.weight in the root's forward

    config = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)
    knobs = {"fetch_unit_size": 0, "persistence_threshold": 0, "max_reuse_distance": 2_000}

    def step(model: nn.Module, device: torch.device) -> torch.Tensor:
        x = torch.randint(0, 64, (2, 16), device=device)
        return model(x, x)

    with torch.device("meta"):
        shape = shape_of(GPT(config))
    measured = _fields(dry_run(lambda: GPT(config), 4, step=step, **knobs))
    assert _fields(estimate(shape, 4, Knobs(**knobs))) != measured  # the read is invisible in the tree
    assert _fields(estimate(shape.with_reads({"": ["wte.weight"]}), 4, Knobs(**knobs))) == measured


def test_model_states_and_traffic_equal_the_zero_formulas_at_world_1024() -> None:
    build = _builder(1024, 256, (1024, 1024))  # every parameter's size divides by 1024 or is persistent-free
    with torch.device("meta"):
        shape = shape_of(build())
    n = 1024
    knobs = Knobs(persistence_threshold=0, max_reuse_distance=0)
    plan = estimate(shape, n, knobs)
    padded = sum(-(-size // n) * n for size in shape.sizes.values())
    assert plan.model_state_bytes == 16 * padded // n
    assert plan.allgather_bytes + plan.reduce_scatter_bytes == 3 * 4 * (n - 1) * padded // n
    assert _fields(dry_run(build, n, step=_step, **vars(knobs))) == _fields(plan)
    mixed = estimate(shape, n, knobs, Widths(param=4, compute=2, reduce=4, state=8))
    assert mixed.allgather_bytes == plan.allgather_bytes // 2 and mixed.model_state_bytes == plan.model_state_bytes


def test_mixed_precision_dry_run_equals_estimate_with_bf16_gathers() -> None:
    from parts.partition import MixedPrecision

    build, knobs = _builder(40, 16, (24,)), {"persistence_threshold": 300, "fetch_unit_size": 0}
    with torch.device("meta"):
        shape = shape_of(build())
    measured = dry_run(build, 8, step=_step, mixed_precision=MixedPrecision(), **knobs)
    assert _fields(estimate(shape, 8, Knobs(**knobs), Widths(compute=2))) == _fields(measured)


def test_attach_of_a_meta_model_names_partitioned_meta() -> None:
    from parts.partition import attach, partitioned

    with partitioned(), torch.device("meta"):  # a placeholder build, as from_pretrained makes
        model = Net(10, 4, ())
    with pytest.raises(ValueError, match=r"'embed.weight'.*partitioned\(device='meta'\)"):
        attach(model)


def _measure_real(vocab: int, width: int, hiddens: tuple, knobs: dict, shard_size: Optional[int] = None) -> dict:
    from parts.comm import block_layout
    from parts.partition import attach, partitioned

    torch.manual_seed(0)
    groups = dict(zip(("group", "replicate_group"), block_layout(shard_size))) if shard_size else {}
    with partitioned(**groups):
        model = Net(vocab, width, hiddens)
    coordinator = attach(model, **knobs)
    try:
        return _fields(measure(model, coordinator, step=_step, device=torch.device("cpu")))
    finally:
        coordinator.detach()


@pytest.mark.parametrize("world", [2, 4])
def test_dry_run_equals_a_real_run(world: int) -> None:
    for knobs in ({}, {"persistence_threshold": 0, "fetch_unit_size": 0, "max_reuse_distance": 3_000,
                       "prefetch_bucket_size": 2_000, "max_live_parameters": 8_000}):
        real = run(world, _measure_real, 50, 24, (40, 33), knobs)
        assert all(r == real[0] for r in real)
        assert real[0] == _fields(dry_run(_builder(50, 24, (40, 33)), world, step=_step, **knobs))


def test_hybrid_dry_run_equals_a_real_2x2_run() -> None:
    knobs = {"persistence_threshold": 500}
    real = run(4, _measure_real, 50, 24, (40, 33), knobs, 2)
    assert all(r == real[0] for r in real) and real[0]["all_reduce_bytes"] > 0
    assert real[0] == _fields(dry_run(_builder(50, 24, (40, 33)), 4, step=_step, shard_size=2, **knobs))


def _meta_and_real_records() -> tuple:
    from parts.partition import meta, partitioned

    with partitioned():
        real = Net(30, 12, (20,))
    with partitioned(device="meta"):
        fake = Net(30, 12, (20,))
    describe = [[(n, meta(p).id - meta(next(iter(m.parameters()))).id, tuple(meta(p).shape),
                  meta(p).layout, meta(p).shard.numel()) for n, p in m.named_parameters()] for m in (real, fake)]
    return describe[0], describe[1], all(meta(p).shard.is_meta for p in fake.parameters())


def test_meta_build_has_the_layouts_ids_and_names_of_a_real_build() -> None:
    for real, fake, on_meta in run(3, _meta_and_real_records):
        assert real == fake and on_meta


def _materialized_equals_plain() -> bool:
    import torch.distributed as dist

    from parts.partition import full_state_dict, materialize, partitioned

    def init(module: nn.Module) -> None:
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()

    torch.manual_seed(1)
    with partitioned(device="meta"):
        model = Net(30, 12, (20, 7))
    torch.manual_seed(5 + dist.get_rank())  # rank 0's values win, as in construction
    materialize(model, init, device=torch.device("cpu"))
    state = full_state_dict(model)
    if dist.get_rank():
        return True
    plain = Net(30, 12, (20, 7))
    torch.manual_seed(5)
    for module in plain.modules():
        init(module)
    return state.keys() == plain.state_dict().keys() and all(
        torch.equal(state[k], v) for k, v in plain.state_dict().items())


def test_materialize_gives_rank_0s_initial_values_bitwise() -> None:
    assert run(2, _materialized_equals_plain) == [True, True]


def test_cli_prints_the_estimate_for_a_hf_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("transformers")
    from parts.plan.__main__ import main

    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, '
                      '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
                      '"vocab_size": 300}')
    args = ["--config", str(config), "--world-size", "16", "--ranks-per-node", "4"]
    assert main(args + ["--memory-per-device", "0.000001"]) == 1  # does not fit a 1 KiB device
    out = capsys.readouterr().out
    assert "world 16 (4 nodes x 4 ranks)" in out and "offload optimizer state" in out
    assert "DeepSpeed estimate" in out
    assert main(args + ["--memory-per-device", "80"]) == 0 and "fits:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--world-size", "4"])  # neither --config nor --model
    assert "one of the arguments --config --model is required" in capsys.readouterr().err
