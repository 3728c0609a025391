"""Reproducible mode (``attach(model, reproducible=True)`` with ``backward_units``): the weights are
the same bits at every world size and layout that divides the units, for AdamW with clipping,
under MixedPrecision, for the whole-tensor optimizers, and across a DCP resume at another world
size; the fixed-point sums are closer to the exact sum than fp32 sums; compression is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Union

import pytest
import torch
import torch.distributed as dist
from harness import run
from hypothesis import given
from hypothesis import strategies as st

UNITS, ROWS, STEPS = 12, 24, 3
LAYOUTS = [1, 2, 3, 4, "2x2"]


class Net(torch.nn.Module):
    """A small MLP with a LayerNorm: matrices for Muon, vectors for AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(torch.nn.functional.gelu(self.a(x))))


def loss_fn(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _batch(step: int) -> tuple:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 4, generator=g)


def _layout(hybrid: Union[bool, str]) -> dict:
    """``partitioned`` arguments: the default group, a 2 x 2 layout (shard groups of two, replicated
    twice), or with ``"nodes"`` full sharding over ranks taken as nodes of two."""
    if hybrid == "nodes":
        return {"ranks_per_node": 2}
    if not hybrid:
        return {}
    rank = dist.get_rank()
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return {"group": rows[rank // 2], "replicate_group": columns[rank % 2]}


def _optimizers(model: torch.nn.Module, kind: str, store: str) -> list:
    from parts.partition import shards
    leaves = shards(model)
    if kind == "adamw":
        return [torch.optim.AdamW(leaves, lr=1e-2, weight_decay=0.1)]
    if kind == "offload":  # shards and AdamW state on disk
        from parts.offload import DiskStore, OffloadedOptimizer
        adamw = torch.optim.AdamW(leaves, lr=1e-2, weight_decay=0.1)
        return [OffloadedOptimizer(adamw, DiskStore(f"{store}-optim-{dist.get_world_size()}-{dist.get_rank()}"))]
    if kind == "adafactor":
        return [torch.optim.Adafactor(leaves, lr=1e-2)]
    if kind == "bf16optimizer":  # it clips by the global norm itself
        from parts.optim import BF16Optimizer
        return [BF16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), clip_grad=0.05, allow_fp32=True)]
    return [torch.optim.Muon([s for s in leaves if s.ndim == 2], lr=2e-2),
            torch.optim.AdamW([s for s in leaves if s.ndim != 2], lr=1e-2)]


def train(hybrid: bool, kind: str = "adamw", bf16: bool = False, steps: int = STEPS,
          save: str = "", load: str = "", store: str = "") -> dict:
    """``steps`` steps of reproducible training, clipped at 0.05; from the checkpoint ``load`` if
    given, saving one to ``save`` at the end if given. The full weights and the mean losses."""
    from parts.comm import dcp as parts_dcp
    from parts.partition import (MixedPrecision, attach, backward_units, clip_grad_norm_, full_state_dict,
                                 partitioned, route)
    torch.manual_seed(0)
    layout = _layout(hybrid)
    if kind == "offload":
        from parts.offload import DiskStore
        layout["remote_device"] = DiskStore(f"{store}-shards-{dist.get_world_size()}-{dist.get_rank()}")
    with partitioned(**layout):
        model = Net()
    attach(model, reproducible=True, mixed_precision=MixedPrecision() if bf16 else None)
    opts = _optimizers(model, kind, store)
    first = _resume(model, opts, load) if load else 0
    losses, norms = [], []
    for step in range(first, first + steps):
        losses.append(float(backward_units(model, _batch(step), UNITS, loss_fn)))
        if kind != "bf16optimizer":
            norms.append(float(clip_grad_norm_(model, 0.05)))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if kind == "bf16optimizer":
            norms.append(opts[0].last_grad_norm)
    if save:
        parts_dcp.save(_state(model, opts, first + steps), checkpoint_id=save)
    return {"weights": full_state_dict(model, rank0_only=False), "losses": losses, "norms": norms,
            "paths": [route(opt) for opt in opts if kind not in ("bf16optimizer", "offload")]}


def _state(model: torch.nn.Module, opts: list, step: int) -> dict:
    from parts.partition import sharded_optimizer_state_dict, sharded_state_dict
    return {"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, opts[0]),
            "step": step}


def _resume(model: torch.nn.Module, opts: list, path: str) -> int:
    import torch.distributed.checkpoint as dcp
    from parts.partition import load_sharded_optimizer_state_dict, load_sharded_state_dict
    state = _state(model, opts, 0)
    dcp.load(state, checkpoint_id=path)
    load_sharded_state_dict(model, state["model"])
    load_sharded_optimizer_state_dict(model, opts[0], state["optim"])
    return state["step"]


def _run(layout: object, *args: object, **kwargs: object) -> dict:
    world = 4 if layout in ("2x2", "nodes") else layout
    results = run(world, train, "nodes" if layout == "nodes" else layout == "2x2", *args, timeout=120, **kwargs)
    for r in results[1:]:  # every rank holds the same full weights
        assert all(torch.equal(r["weights"][k], v) for k, v in results[0]["weights"].items())
    return results[0]


def _assert_equal(results: dict) -> None:
    first = next(iter(results.values()))
    for layout, r in results.items():
        assert r["losses"] == first["losses"] and r["norms"] == first["norms"], layout
        for k, v in first["weights"].items():
            assert torch.equal(r["weights"][k], v), (layout, k)


def reference(steps: int = STEPS) -> dict:
    """Plain torch in float64 on one process: the loss of all rows, AdamW, clipped at 0.05."""
    torch.manual_seed(0)
    model = Net().double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        x, y = _batch(step)
        torch.nn.functional.mse_loss(model(x.double()), y.double()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    return {k: v.float() for k, v in model.state_dict().items()}


def test_adamw_with_clipping_gives_the_same_bits_at_world_1_2_3_4_and_2x2() -> None:
    results = {layout: _run(layout) for layout in LAYOUTS}
    _assert_equal(results)
    expected = reference()
    for k, v in results[1]["weights"].items():  # and it is the training the float64 run does
        assert torch.allclose(v, expected[k], atol=1e-5), k
    assert results[1]["norms"][0] > 0.05  # the clip scaled the grads


def test_mixed_precision_bf16_gives_the_same_bits_at_world_1_2_3_and_2x2() -> None:
    _assert_equal({layout: _run(layout, bf16=True) for layout in (1, 2, 3, "2x2")})


@pytest.mark.parametrize("bf16", [False, True])
def test_two_nodes_of_two_ranks_give_the_same_bits_as_one_process(bf16: bool) -> None:
    _assert_equal({layout: _run(layout, bf16=bf16) for layout in (1, "nodes")})


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_whole_tensor_optimizers_give_the_same_bits_at_world_1_2_3_4_and_2x2(kind: str) -> None:
    results = {layout: _run(layout, kind) for layout in LAYOUTS}
    _assert_equal(results)
    assert all(r["paths"][0] == "whole" for r in results.values())


def test_muon_with_adamw_gives_the_same_bits_at_world_1_and_3() -> None:
    results = {layout: _run(layout, "muon") for layout in (1, 3)}
    _assert_equal(results)
    assert results[3]["paths"] == ["whole", "shard"]


def test_bf16optimizer_clipping_gives_the_same_bits_at_world_1_and_3() -> None:
    results = {layout: _run(layout, "bf16optimizer") for layout in (1, 3)}
    _assert_equal(results)
    assert results[1]["norms"][0] > 0.05


def test_shards_and_optimizer_state_on_disk_give_the_same_bits_at_world_1_and_3(tmp_path: Path) -> None:
    results = {layout: _run(layout, "offload", store=str(tmp_path / f"w{layout}")) for layout in (1, 3)}
    _assert_equal(results)
    _assert_equal({"memory": _run(1), "disk": results[1]})


def test_a_run_saved_at_world_2_and_resumed_at_world_3_equals_the_world_4_run(tmp_path: Path) -> None:
    whole = _run(4, steps=2 * STEPS)
    saved = _run(2, steps=STEPS, save=str(tmp_path / "ckpt"))
    resumed = _run(3, steps=STEPS, load=str(tmp_path / "ckpt"))
    assert saved["losses"] + resumed["losses"] == whole["losses"]
    for k, v in whole["weights"].items():
        assert torch.equal(resumed["weights"][k], v), k


def compression_refused() -> str:
    from parts.partition import Compression, attach, partitioned
    with partitioned():
        model = Net()
    try:
        attach(model, reproducible=True, compression=Compression())
    except ValueError as err:
        return str(err)
    return ""


def test_compression_refuses_reproducible_mode_naming_the_knob() -> None:
    for message in run(2, compression_refused):
        assert "reproducible=True" in message and "compression=" in message


def test_units_of_very_different_magnitude_sum_to_the_same_bits_at_every_world_size() -> None:
    scales = [1.0, 3e5, 1.0, 2e-6, 7.0, 1.0, 0.5, 1.0, 4e3, 1.0, 1.0, 9e-4]
    results = {w: run(w, gathered_grads, scales, {}) for w in (1, 2, 3, 4)}
    results["two nodes"] = run(4, gathered_grads, scales, {"ranks_per_node": 2})
    assert results[1][0]["exponents"] > 1  # the sums are kept at several exponents
    for w, ranks in results.items():
        for k, v in results[1][0]["grads"].items():
            assert torch.equal(torch.cat([r["grads"][k] for r in ranks])[:v.numel()], v), (w, k)


def test_a_unit_with_a_nonfinite_grad_makes_every_grad_shard_and_the_norm_nan_at_every_world_size() -> None:
    scales = [1.0] * 12
    scales[5] = float("inf")  # one unit's targets, so its loss and grads are not finite
    results = {w: run(w, gathered_grads, scales, {}) for w in (1, 2, 3)}
    results["two nodes"] = run(4, gathered_grads, scales, {"ranks_per_node": 2})
    for w, ranks in results.items():
        for r in ranks:
            assert all(bool(g.isnan().all()) for g in r["grads"].values()), w
            assert bool(r["norm"].isnan()), w


def gathered_grads(scales: list, layout: dict) -> dict:
    """One backward of units whose targets differ in scale by ``scales`` (so their grads get
    different exponents and a reduce-scatter carries several), sharded with ``layout``
    (``partitioned`` arguments): this rank's grad shards and the grad norm."""
    from parts.partition import attach, backward_units, grad_norm, meta, partitioned
    torch.manual_seed(0)
    with partitioned(**layout):
        model = Net()
    attach(model, reproducible=True)
    x, y = _batch(0)
    y = y * torch.tensor(scales).repeat_interleave(ROWS // len(scales))[:, None]
    backward_units(model, (x, y), len(scales), loss_fn)
    return {"grads": {name: meta(p).grad_shard.clone() for name, p in model.named_parameters()},
            "exponents": max(len(meta(p).exact.sums) for p in model.parameters()),
            "norm": grad_norm(model)}


def sum_errors() -> dict:
    """The fixed-point grad of 12 units against the float64 sum of the same fp32 unit grads, beside the
    fp32 sum of them (what accumulating them in a grad does): the largest error relative to each
    parameter's largest grad, and the share of elements not the correctly rounded sum."""
    from parts.partition import attach, backward_units, meta, partitioned
    torch.manual_seed(0)
    plain = Net()
    torch.manual_seed(0)
    with partitioned():
        model = Net()
    attach(model, reproducible=True)
    batch = _batch(0)
    backward_units(model, batch, UNITS, loss_fn)
    exact64 = {k: torch.zeros_like(p, dtype=torch.float64) for k, p in plain.named_parameters()}
    fp32 = {k: torch.zeros_like(p) for k, p in plain.named_parameters()}
    for unit in range(UNITS):
        rows = slice(unit * ROWS // UNITS, (unit + 1) * ROWS // UNITS)
        plain.zero_grad()
        (loss_fn(plain, (batch[0][rows], batch[1][rows])) / UNITS).backward()
        for k, p in plain.named_parameters():
            exact64[k] += p.grad.double()
            fp32[k] += p.grad
    out = {"fixed": 0.0, "fp32": 0.0, "fixed_off": 0, "fp32_off": 0, "numel": 0}
    for k, p in model.named_parameters():
        fixed, truth = meta(p).grad_shard.view(p.shape), exact64[k]
        scale = float(truth.abs().max())
        out["fixed"] = max(out["fixed"], float((fixed.double() - truth).abs().max()) / scale)
        out["fp32"] = max(out["fp32"], float((fp32[k].double() - truth).abs().max()) / scale)
        out["fixed_off"] += int((fixed != truth.float()).sum())
        out["fp32_off"] += int((fp32[k] != truth.float()).sum())
        out["numel"] += p.numel()
    return out


def test_fixed_point_sums_are_closer_to_the_float64_sum_than_fp32_sums() -> None:
    errors = run(1, sum_errors)[0]
    assert errors["fixed"] <= errors["fp32"] and errors["fixed_off"] <= errors["fp32_off"], errors
    assert errors["fixed_off"] == 0, errors  # every element is the correctly rounded sum here


@given(st.floats(min_value=1e-40, max_value=1e30, allow_nan=False), st.integers(0, 2 ** 20))
def test_a_unit_exponent_keeps_the_unit_below_2_to_the_50_and_above_2_to_the_34(top: float, seed: int) -> None:
    from parts.base.fixed_point import GRID, UNIT_BITS, unit_exponent
    e = unit_exponent(top)
    assert e % GRID == 0
    assert top * 2.0 ** e < 2.0 ** UNIT_BITS and (top * 2.0 ** e >= 2.0 ** 34 or e == 960)


@given(st.integers(0, 2 ** 20), st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 112))
def test_quantize_is_the_float64_rounding_of_the_exact_product(seed: int, dtype: torch.dtype, exponent: int) -> None:
    from parts.base.fixed_point import quantize
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(257, generator=g) * torch.logspace(-30, 0, 257)).to(dtype) * 2.0 ** -exponent
    assert torch.equal(quantize(values, exponent), (values.double() * 2.0 ** exponent).round().long())


@given(st.integers(0, 2 ** 20))
def test_split_squares_sum_to_the_exact_sum_of_squares(seed: int) -> None:
    from fractions import Fraction
    from parts.base.fixed_point import join_squares, split_squares, square_exponents
    values = torch.randn(300, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-8, 2, 300)
    e, e_low = square_exponents(float(values.abs().max().double() ** 2), values.numel())
    high, low = split_squares(values, e, e_low)
    exact = sum(Fraction(v) ** 2 for v in values.double().tolist())
    assert abs(Fraction(join_squares(int(high), int(low), e, e_low)) - exact) <= exact * Fraction(1, 2 ** 50)
    assert (high, low) == split_squares(values.flip(0), e, e_low)  # any order, the same words


def train_gpt_model(hybrid: bool, bf16: bool, steps: int, kind: str = "adamw") -> dict:
    """The main recipe's GPT (small), fp32 masters, clipped at 1.0, 12 units of 2 sequences per step:
    AdamW, Muon on the matrices with AdamW on the rest (``muon``), or Adafactor."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
    from gpt_model import GPT, GPTConfig
    from parts.partition import (MixedPrecision, attach, backward_units, clip_grad_norm_, full_state_dict,
                                 partitioned, route, shards)
    torch.manual_seed(0)
    with partitioned(**_layout(hybrid)):
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    attach(model, reproducible=True, mixed_precision=MixedPrecision() if bf16 else None)
    opts = _gpt_optimizers(shards(model), kind)
    losses = []
    for step in range(steps):
        starts = torch.randint(0, 64, (24, 1), generator=torch.Generator().manual_seed(step))
        tokens = (starts + torch.arange(17)) % 64  # a sequence to learn: each token follows the last
        batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        losses.append(float(backward_units(model, batch, UNITS, lambda m, b: m(*b))))
        clip_grad_norm_(model, 1.0)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {"weights": full_state_dict(model, rank0_only=False), "losses": losses, "norms": [],
            "paths": [route(opt) for opt in opts]}


def _gpt_optimizers(leaves: list, kind: str) -> list:
    """The optimizers of ``train_gpt_model``'s ``kind`` over the shards ``leaves``."""
    if kind == "adafactor":
        return [torch.optim.Adafactor(leaves, lr=1e-2)]
    if kind == "muon":
        return [torch.optim.Muon([s for s in leaves if s.ndim == 2], lr=2e-2),
                torch.optim.AdamW([s for s in leaves if s.ndim != 2], lr=3e-3, betas=(0.9, 0.95))]
    return [torch.optim.AdamW(leaves, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)]


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True])
def test_the_recipe_gpt_gives_the_same_bits_at_world_1_2_3_4_and_2x2(bf16: bool) -> None:
    results = {}
    for layout in LAYOUTS:
        ranks = run(4 if layout == "2x2" else layout, train_gpt_model, layout == "2x2", bf16, 50, timeout=300)
        results[layout] = ranks[0]
    _assert_equal(results)
    assert results[1]["losses"][-1] < results[1]["losses"][0]  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_the_recipe_gpt_with_a_whole_tensor_optimizer_gives_the_same_bits_at_world_1_2_3_4_and_2x2(kind: str) -> None:
    results = {}
    for layout in LAYOUTS:
        ranks = run(4 if layout == "2x2" else layout, train_gpt_model, layout == "2x2", False, 50, kind, timeout=300)
        results[layout] = ranks[0]
    _assert_equal(results)
    assert results[3]["paths"][0] == "whole"  # stepped on the full tensors by their owners
    assert results[1]["losses"][-1] < results[1]["losses"][0]  # it trained


def test_units_not_divisible_by_the_world_size_are_refused() -> None:
    from parts.partition import unit_range
    assert list(unit_range(12, 2, 4)) == [6, 7, 8]
    with pytest.raises(ValueError, match="units=12 is not divisible by the world size 5"):
        unit_range(12, 0, 5)


def scaled_then_more_units() -> str:
    from parts.partition import attach, backward_units, clip_grad_norm_, partitioned
    torch.manual_seed(0)
    with partitioned():
        model = Net()
    attach(model, reproducible=True)
    backward_units(model, _batch(0), 4, loss_fn)
    clip_grad_norm_(model, 1e-3)  # scales the grad shards in place
    try:
        backward_units(model, _batch(1), 4, loss_fn)  # without zero_grad: the sums no longer say what they hold
    except RuntimeError as err:
        return str(err)
    return ""


def test_a_grad_shard_changed_between_backwards_without_zero_grad_raises_naming_the_parameter() -> None:
    message = run(1, scaled_then_more_units)[0]
    assert "was changed outside the gradient reduction" in message and "parameter 'a.weight'" in message, message


def large_grad_norm() -> dict:
    """A parameter larger than the quantizing and squaring pieces: its grad shards and the clip norm,
    beside the float64 norm of the gathered grad."""
    from parts.comm.exact_norm import CHUNK
    from parts.partition import attach, backward_units, clip_grad_norm_, meta, partitioned
    torch.manual_seed(0)
    with partitioned():
        model = torch.nn.Linear(1024, 600)
    assert model.weight.numel() > 2 * CHUNK
    attach(model, reproducible=True)
    x = torch.randn(6, 1024, generator=torch.Generator().manual_seed(1))
    backward_units(model, (x,), 6, lambda m, b: m(b[0]).square().mean())
    grads = {k: meta(p).grad_shard.clone() for k, p in model.named_parameters()}
    return {"grads": grads, "norm": clip_grad_norm_(model, 1e9)}


def test_a_large_parameter_has_the_same_grad_and_norm_at_world_1_2_and_3() -> None:
    results = {w: run(w, large_grad_norm) for w in (1, 2, 3)}
    first = results[1][0]
    truth = torch.cat([g.double() for g in first["grads"].values()]).norm()
    assert abs(float(first["norm"]) - float(truth)) <= 1e-6 * float(truth)
    for w, ranks in results.items():
        assert all(torch.equal(r["norm"], first["norm"]) for r in ranks), w
        for k, v in first["grads"].items():
            assert torch.equal(torch.cat([r["grads"][k] for r in ranks])[:v.numel()], v), (w, k)


def grad_reduction_bytes(reproducible: bool, layout: dict) -> dict:
    """One backward of ``Net`` sharded with ``layout`` (``partitioned`` arguments), attached with or
    without ``reproducible``: the bytes this rank sent per group and kind, and the parameter count."""
    from parts.comm import comm_counter
    from parts.partition import attach, partitioned
    torch.manual_seed(0)
    with partitioned(**layout):
        model = Net()
    attach(model, reproducible=reproducible)
    before = comm_counter.by_group()
    loss_fn(model, _batch(0)).backward()
    sent = {group: {kind: count - before.get(group, {}).get(kind, 0) for kind, count in kinds.items()}
            for group, kinds in comm_counter.by_group().items()}
    return {"sent": sent, "params": len(list(model.parameters()))}


@pytest.mark.parametrize("world", [2, 3])
def test_the_exact_grad_exchange_sends_the_default_reduce_scatters_bytes_and_one_code_per_parameter(world: int) -> None:
    default, exact = (run(world, grad_reduction_bytes, mode, {})[0] for mode in (False, True))
    group = ",".join(map(str, range(world)))
    default_sent, exact_sent = default["sent"][group], exact["sent"][group]
    assert default_sent.get("all_to_all_bytes", 0) == 0 and exact_sent.get("reduce_scatter_bytes", 0) == 0
    codes = (world - 1) * 4 * exact["params"]  # one fp32 code per parameter to each other rank
    assert exact_sent["all_to_all_bytes"] == default_sent["reduce_scatter_bytes"] + codes


def test_over_two_nodes_the_exact_exchange_crosses_between_nodes_once_as_int64_sums() -> None:
    """World 4 taken as two nodes of two ranks: within the node the exchange sends the default
    reduce-scatter's bytes plus the codes; across the nodes (rank 0's group with rank 2) the
    node's int64 sums, twice the default's fp32 sums (every parameter's units share one exponent
    here), and a small MAX all-reduce of the exponent spans."""
    default, exact = (run(4, grad_reduction_bytes, mode, {"ranks_per_node": 2})[0] for mode in (False, True))
    node, across = exact["sent"]["0,1"], exact["sent"]["0,2"]
    assert node["all_to_all_bytes"] == default["sent"]["0,1"]["reduce_scatter_bytes"] + 4 * exact["params"]
    assert across["reduce_scatter_bytes"] == 2 * default["sent"]["0,2"]["reduce_scatter_bytes"]
    assert across["check_bytes"] == 3 * 8 * exact["params"]  # [highest, -lowest, nonfinite] per parameter


class TwoExperts(torch.nn.Module):
    """A shared layer, then one of two experts, picked by the unit's data (as a router picks them)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[int(x[0, 0] > 0)](torch.relu(self.inp(x)))


def train_experts() -> dict:
    """3 reproducible steps of ``TwoExperts`` over 4 units of which one takes expert 0, clipped at 0.05."""
    from parts.partition import attach, backward_units, clip_grad_norm_, full_state_dict, partitioned, shards
    torch.manual_seed(0)
    with partitioned():
        model = TwoExperts()
    attach(model, reproducible=True)
    start = full_state_dict(model, rank0_only=False)["experts.0.weight"]
    opt = torch.optim.AdamW(shards(model), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 8, generator=data), torch.randn(8, 4, generator=data)
        x[:, 0] = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 1.0])  # unit 1 alone takes expert 0
        backward_units(model, (x, y), 4, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
        clip_grad_norm_(model, 0.05)
        opt.step()
        opt.zero_grad()
    return {"weights": full_state_dict(model, rank0_only=False), "losses": [], "norms": [], "start": start}


def test_units_that_run_different_experts_give_the_same_bits_at_world_1_2_and_4() -> None:
    """At world 2 rank 1, and at world 4 ranks 0, 2 and 3, never run expert 0 in the step."""
    results = {w: run(w, train_experts, timeout=120)[0] for w in (1, 2, 4)}
    _assert_equal(results)
    assert not torch.equal(results[1]["weights"]["experts.0.weight"], results[1]["start"])  # expert 0 trained
