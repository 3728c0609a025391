"""parts.plan: meta construction, materialize, and plans that equal what the code does.

The estimate (arithmetic, no process group) equals the dry run (the real coordinator on a
fake world, built on meta) byte for byte across models, world sizes and knobs; the dry run
equals a real gloo run's counters at world 2 and 4; the model-state bytes equal the ZeRO
formulas where no shard is padded.
"""

from __future__ import annotations

import dataclasses
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


_LLAMA = ('{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, '
          '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300')


@pytest.mark.parametrize("args,said", [
    (["--world-size", "12", "--ranks-per-node", "8"], "--world-size 12 is not a whole number of nodes"),
    (["--world-size", "4", "--ranks-per-node", "0"], "--ranks-per-node: must be at least 1, got 0"),
    (["--world-size", "0"], "--world-size: must be at least 1, got 0"),
    (["--world-size", "4", "--memory-per-device", "-5"], "--memory-per-device: must be more than 0, got -5"),
    (["--world-size", "8", "--shard-size", "3"], "--shard-size 3 does not divide --world-size 8"),
    (["--world-size", "4", "--persistence-threshold", "-1"], "--persistence-threshold: must be at least 0")])
def test_cli_refuses_impossible_values_with_argparse_errors(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                            args: list, said: str) -> None:
    """Before: accepted ('2 nodes x 8 ranks', '8 nodes x 1 ranks'), a ZeroDivisionError, or advice for -5 GiB."""
    from parts.plan.__main__ import main

    config = tmp_path / "config.json"
    config.write_text(_LLAMA + "}")
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(config), *args])
    assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_cli_plans_a_bfloat16_config_alike_in_the_estimate_and_the_dry_run(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture) -> None:
    """Before: the estimate planned fp32 silently and the dry run raised a TypeError about bf16 shards."""
    pytest.importorskip("transformers")
    from parts.plan.__main__ import _knobs, _parse, _plan, main
    from parts.plan.models import hf_builder

    config = tmp_path / "config.json"
    config.write_text(_LLAMA + ', "torch_dtype": "bfloat16"}')
    plans = {}
    for extra in ([], ["--dry-run"], ["--dtype", "bf16-mixed"], ["--dtype", "fp32"]):
        argv = ["--config", str(config), "--world-size", "4", *extra]
        assert main(argv) == 0
        said = "fp32, as given" if "fp32" in extra else "bf16-mixed, as given" if extra[:1] == ["--dtype"] else \
            "bf16-mixed (fp32 shards are the masters"
        assert f"the config's torch_dtype bfloat16: planned as --dtype {said}" in capsys.readouterr().out
        args = _parse(argv)
        plans[" ".join(extra)] = _fields(_plan(args, hf_builder(str(config)), _knobs(args)))
    assert plans[""] == plans["--dry-run"] == plans["--dtype bf16-mixed"]  # estimated, run, or given
    assert plans[""]["allgather_bytes"] * 2 == plans["--dtype fp32"]["allgather_bytes"] > 0  # bf16 gathers


def test_cli_advice_names_the_smallest_world_size_that_fits(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Before: 'more ranks: model states shrink as 1/N' without saying how many."""
    import re

    from parts.plan.__main__ import main

    config = tmp_path / "config.json"
    config.write_text(_LLAMA + "}")
    base = ["--config", str(config), "--ranks-per-node", "4", "--persistence-threshold", "0"]
    limit = str(0.7 / 1024)  # GiB: 0.7 MiB, between the peaks of worlds 4 and 8 (0.86 and 0.65 MiB)
    assert main(base + ["--world-size", "2", "--memory-per-device", limit]) == 1
    world = int(re.search(r"--world-size (\d+) is the smallest that fits", capsys.readouterr().out).group(1))
    assert world == 8
    assert main(base + ["--world-size", "8", "--memory-per-device", limit]) == 0
    assert main(base + ["--world-size", "4", "--memory-per-device", limit]) == 1
    assert main(base + ["--world-size", "2", "--memory-per-device", "0.0001"]) == 1
    assert "more ranks cannot make it fit" in capsys.readouterr().out  # the gathered peak alone is over


def test_advice_omits_moves_worth_less_than_a_hundredth_of_the_peak() -> None:
    """Before: 'persistence_threshold=0: 0.00 GiB of kept full copies leave memory'."""
    from parts.plan.layout_bytes import GIB, Plan
    from parts.plan.report import advice

    plan = Plan(world_size=8, params=10**9, param_bytes=GIB, grad_bytes=GIB, optimizer_bytes=2 * GIB,
                persistent_bytes=4096, gathered_peak_bytes=GIB, allgather_bytes=0, reduce_scatter_bytes=0,
                all_reduce_bytes=0)
    lines = advice(plan, 2.0)
    assert lines[0].startswith("does not fit: 5.00 GiB > 2 GiB")
    assert any("OffloadedOptimizer): 2.00 GiB" in line for line in lines)
    assert not any("persistence_threshold" in line for line in lines)
    assert "persistence_threshold=0: 0.50 GiB" in "".join(advice(dataclasses.replace(plan, persistent_bytes=GIB // 2),
                                                                 2.0))


_L3_70B = {"vocab": 128256, "width": 8192, "kv": 1024, "inter": 28672, "layers": 80}  # Llama-3-70B


class _Llama3Layer(nn.Module):
    """One decoder layer's parameters: attention with grouped KV heads, a SwiGLU MLP, two RMSNorms."""

    def __init__(self, width: int, kv: int, inter: int) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(width, width, bias=False), nn.Linear(width, width, bias=False)
        self.k, self.v = nn.Linear(width, kv, bias=False), nn.Linear(width, kv, bias=False)
        self.gate, self.up = nn.Linear(width, inter, bias=False), nn.Linear(width, inter, bias=False)
        self.down = nn.Linear(inter, width, bias=False)
        self.norm1, self.norm2 = nn.RMSNorm(width), nn.RMSNorm(width)


def llama3_70b() -> nn.Module:
    """Llama-3-70B's parameter shapes (untied embedding and head), for ``--model test_plan:llama3_70b``."""
    c = _L3_70B
    model = nn.Module()
    model.embed = nn.Embedding(c["vocab"], c["width"])
    model.layers = nn.ModuleList(_Llama3Layer(c["width"], c["kv"], c["inter"]) for _ in range(c["layers"]))
    model.norm = nn.RMSNorm(c["width"])
    model.head = nn.Linear(c["width"], c["vocab"], bias=False)
    return model


def test_cli_reference_rows_are_the_zero_papers_mixed_precision_formulas_for_a_bf16_70b(
        capsys: pytest.CaptureFixture) -> None:
    """Before: ZeRO-1 533.88 GiB and ZeRO-2 275.15 GiB, the fp32 formulas, under a bf16 plan."""
    import re

    from parts.plan.__main__ import main

    v, h, kv, inter, layers = (_L3_70B[k] for k in ("vocab", "width", "kv", "inter", "layers"))
    psi = 2 * v * h + layers * (2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h) + h
    n, largest = 64, v * h  # the embedding (and the head) is DeepSpeed's largest layer

    def gib(nbytes: float) -> float:
        return round(nbytes / 2**30, 2)

    assert main(["--model", "test_plan:llama3_70b", "--world-size", str(n), "--dtype", "bf16-mixed"]) == 0
    out = capsys.readouterr().out
    rows = {name: float(value.replace(",", "")) for name, value in
            re.findall(r"^  (DDP|ZeRO-\d|parts \(this plan\)|DeepSpeed estimate_zero3 \(GPU, no offload\)) +"
                       r"([\d,.]+) GiB$", out, re.M)}
    assert f"{psi / 1e9:,.3f} B parameters" in out
    k = 12  # mixed-precision AdamW: fp32 masters, momentum and variance
    assert rows["ZeRO-1"] == gib(2 * psi + 2 * psi + k * psi / n) == 275.15
    assert rows["ZeRO-2"] == gib(2 * psi + (2 + k) * psi / n) == 145.79
    assert rows["ZeRO-3"] == gib((2 + 2 + k) * psi / n) == rows["parts (this plan)"] == 16.43
    assert rows["DDP"] == gib((2 + 2 + k) * psi)
    assert rows["DeepSpeed estimate_zero3 (GPU, no offload)"] == gib(18 * psi / n + 4 * largest) == 22.39
    assert f"where ZeRO-3 has 16 (+{gib(2 * psi / n):.2f} GiB)" in out
    assert f"largest module's {largest:,} elements (+{gib(4 * largest):.2f} GiB)" in out


@given(psi=st.integers(1, 10**12), world=st.integers(1, 4096), dtype=st.sampled_from(["fp32", "bf16-mixed"]))
def test_reference_rows_are_the_zero_formulas_of_the_planned_dtype(psi: int, world: int, dtype: str) -> None:
    """fp32 AdamW: 4 + 4 + 8 bytes per parameter; bf16 mixed precision: 2 + 2 + 12 (the paper's K)."""
    import math

    from parts.plan.__main__ import _DTYPES
    from parts.plan.report import zero_reference

    p, k = (4, 8) if dtype == "fp32" else (2, 12)
    ref = zero_reference(psi, world, _DTYPES[dtype])
    assert ref.ddp() == (2 * p + k) * psi
    assert ref.zero1() == 2 * p * psi + math.ceil(k * psi / world)
    assert ref.zero2() == p * psi + math.ceil((p + k) * psi / world)
    assert ref.zero3() == math.ceil((2 * p + k) * psi / world)
