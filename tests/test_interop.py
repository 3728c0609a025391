"""parts in the training loops people already have: model.zero_grad, clipping,
.to()/.float(), buffers. World 2, each against the plain-PyTorch run on the whole batch."""

import pytest
import torch

from harness import run
from parts.partition import meta, shards
from parts.partition.coordinator import attach
from test_coordinator_models import VOCAB, GPT, batch, full_params, make_pair, rank_info

PER_RANK, STEPS = 2, 4


def _train(model, opt, steps: int, rows: int, offset: int, zero: str, clip=None) -> list:
    """Plain loop; ``zero`` says who clears grads ("model" or "optimizer"); returns norms."""
    norms = []
    for step in range(steps):
        model(*batch(step, rows, offset)).backward()
        if clip is not None:
            norms.append(float(clip()))
        opt.step()
        (model if zero == "model" else opt).zero_grad()
    return norms


def _zero_grad_case(steps: int) -> tuple:
    rank, world = rank_info()
    ref, model = make_pair(GPT)
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), steps, PER_RANK * world, 0, "model")
    coordinator = attach(model, persistence_threshold=0)
    _train(model, torch.optim.SGD(shards(model), lr=0.1), steps, PER_RANK, rank * PER_RANK, "model")
    leftover = [meta(p).grad_shard for p in model.parameters()]
    model.zero_grad(set_to_none=False)  # torch's in-place variant reaches the grad shards too
    coordinator.detach()
    restored = all("zero_grad" not in sub.__dict__ for sub in model.modules())
    return [p.detach() for p in ref.parameters()], full_params(model), leftover, restored


def test_model_zero_grad_clears_grad_shards():
    # SGD on fp32; the only difference from the reference is the order of the gradient sum
    # (per-rank means averaged across ranks): final params agree to 1e-6.
    for ref_params, got, leftover, restored in run(2, _zero_grad_case, STEPS):
        assert all(g is None for g in leftover)
        assert restored
        for a, b in zip(ref_params, got):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _clip_case(steps: int, max_norm: float, knobs: dict) -> tuple:
    from parts.partition import clip_grad_norm_
    rank, world = rank_info()
    ref, model = make_pair(GPT)
    ref_clip = lambda: torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)  # noqa: E731
    ref_norms = _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), steps, PER_RANK * world, 0,
                       "optimizer", ref_clip)
    attach(model, **knobs)
    norms = _train(model, torch.optim.SGD(shards(model), lr=0.1), steps, PER_RANK, rank * PER_RANK,
                   "optimizer", lambda: clip_grad_norm_(model, max_norm))
    return ref_norms, norms, [p.detach() for p in ref.parameters()], full_params(model)


@pytest.mark.parametrize("knobs", [dict(persistence_threshold=0), dict()])
def test_clip_grad_norm_is_the_global_norm(knobs):
    # Same fp32 math as the reference up to the order of sums (per-rank means averaged, the
    # norm summed shard by shard): norms agree to 1e-5 relative, params to 1e-6.
    for ref_norms, norms, ref_params, got in run(2, _clip_case, STEPS, 0.5, knobs):
        assert min(ref_norms) > 0.5  # clipping really happened at every step
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        for a, b in zip(ref_params, got):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _torch_clip_case(knobs: dict, target: str) -> str:
    rank, _ = rank_info()
    _, model = make_pair(GPT)
    attach(model, **knobs)
    model(*batch(0, PER_RANK, rank * PER_RANK)).backward()
    params = model.parameters() if target == "model" else shards(model)
    try:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    except RuntimeError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("target", ["model", "shards"])
@pytest.mark.parametrize("knobs", [dict(persistence_threshold=0), dict()])
def test_torch_clip_grad_norm_raises_naming_parts_clip(knobs, target):
    for message in run(2, _torch_clip_case, knobs, target):
        assert "parts.partition.clip_grad_norm_(model, max_norm)" in message, message


def _fused_case() -> tuple:
    from parts.partition import use_shards
    rank, world = rank_info()
    ref, model = make_pair(GPT)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    _train(ref, ref_opt, STEPS, PER_RANK * world, 0, "model")
    attach(model)  # default persistence: small params stay gathered between steps
    opt = use_shards(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))  # built as HF does
    _train(model, opt, STEPS, PER_RANK, rank * PER_RANK, "model")
    return [p.detach() for p in ref.parameters()], full_params(model)


def test_fused_optimizer_on_shards_equals_plain():
    # fused AdamW writes the shards without bumping their version counters: before, the
    # params kept gathered between steps were used stale (HF Trainer's default optimizer, 1e-3
    # off after one step). Elementwise fp32 math on shards, grads averaged over 2 ranks in
    # another order than the full-batch mean: params agree to 1e-6.
    for ref_params, got in run(2, _fused_case):
        for a, b in zip(ref_params, got):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _to_case() -> tuple:
    rank, world = rank_info()
    ref, model = make_pair(GPT)
    attach(model)
    same = [model.to("cpu"), model.to(torch.device("cpu")), model.float(), model.to(torch.float32),
            model.cpu(), model.to("cpu", torch.float32)]
    errors = []
    for convert in (lambda m: m.bfloat16(), lambda m: m.to(torch.float64), lambda m: m.half()):
        try:
            convert(model)
            errors.append("no error")
        except RuntimeError as err:
            errors.append(str(err))
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), 2, PER_RANK * world, 0, "optimizer")
    _train(model, torch.optim.SGD(shards(model), lr=0.1), 2, PER_RANK, rank * PER_RANK, "optimizer")
    return (all(m is model for m in same), errors, [p.detach() for p in ref.parameters()],
            full_params(model))


def test_to_and_float_are_no_ops_or_clear_errors():
    # no-op conversions leave training equal to the plain run (SGD, fp32: 1e-6 as above)
    for all_same, errors, ref_params, got in run(2, _to_case):
        assert all_same
        for message, dtype in zip(errors, ("bfloat16", "float64", "float16")):
            assert f"partitioned(dtype=torch.{dtype}" in message and "'wte.weight'" in message, message
        for a, b in zip(ref_params, got):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 1))


def _bn_batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 10 + rank)
    return torch.randn(4, 6, generator=g) * (rank + 1) + rank  # rank-dependent statistics


def _bn_case(sync: bool) -> tuple:
    import copy
    from torch.nn.parallel import DistributedDataParallel
    from parts.partition import partition_module
    rank, _ = rank_info()
    ref = DistributedDataParallel(_bn_model())  # broadcast_buffers=True
    model = partition_module(copy.deepcopy(ref.module))
    attach(model, sync_buffers=sync)
    for net, params in ((ref, ref.parameters()), (model, shards(model))):
        opt = torch.optim.SGD(params, lr=0.1)
        for step in range(3):
            net(_bn_batch(step, rank)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    probe = torch.linspace(-2, 2, 12).reshape(2, 6)
    ref.eval(), model.eval()
    with torch.no_grad():
        ref_out, out = ref(probe), model(probe)
    return ref_out, out, model[1].running_mean.clone()


def test_sync_buffers_keeps_batchnorm_statistics_equal_to_ddp():
    # DDP broadcasts rank 0's buffers before every training forward; so does attach(sync_buffers=True),
    # and again before the first evaluation after training, so eval agrees on every rank.
    # Tolerance 1e-6: the same fp32 math as DDP but for the order of the gradient sum.
    (ref0, out0, mean0), (_, out1, mean1) = run(2, _bn_case, True)
    assert torch.equal(out0, out1) and torch.equal(mean0, mean1)
    torch.testing.assert_close(out0, ref0, rtol=1e-5, atol=1e-6)
    (_, out0, mean0), (_, out1, mean1) = run(2, _bn_case, False)
    assert not torch.equal(mean0, mean1)  # without it each rank keeps its own statistics


# ------------------------------------------------------------- pretrained weights (item 5)
def _write_safetensors(path: str, tensors: dict) -> None:
    """A safetensors file without numpy (the format: header length, JSON header, raw bytes)."""
    import json
    import struct
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}
    header, blobs, offset = {}, [], 0
    for key, t in tensors.items():
        raw = bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())
        header[key] = {"dtype": names[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


class Tied(torch.nn.Module):
    """HF-style: ``base_model_prefix``, a tied head, a buffer, a 0-d parameter."""

    base_model_prefix = "body"

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.ModuleDict(dict(emb=torch.nn.Embedding(13, 5), ln=torch.nn.LayerNorm(5)))
        self.head = torch.nn.Linear(5, 13, bias=False)
        self.head.weight = self.body["emb"].weight
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.register_buffer("steps", torch.tensor([3, 4]))


def _pretrained_case(folder: str, strict: bool) -> tuple:
    from parts.partition import full_state_dict, load_pretrained, num_parameters, partitioned
    torch.manual_seed(1)
    ref = Tied()
    with partitioned():
        torch.manual_seed(2)
        model = Tied()
    keys = load_pretrained(model, folder, strict=strict)
    return (keys.missing_keys, keys.unexpected_keys, ref.state_dict(), full_state_dict(model),
            num_parameters(model), sum(p.numel() for p in ref.parameters()))


def _save_hf_style(folder, ref: torch.nn.Module, extra: dict) -> None:
    """Two files and an index, keys without the base-model prefix, the tied head omitted."""
    import json
    sd = {k.removeprefix("body."): v for k, v in ref.state_dict().items() if k != "head.weight"}
    sd.update(extra)
    keys = sorted(sd)
    parts_ = {"model-00001-of-00002.safetensors": keys[:2], "model-00002-of-00002.safetensors": keys[2:]}
    for name, ks in parts_.items():
        _write_safetensors(str(folder / name), {k: sd[k] for k in ks})
    index = {"metadata": {}, "weight_map": {k: n for n, ks in parts_.items() for k in ks}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_load_pretrained_fills_shards_from_hf_style_safetensors(tmp_path):
    pytest.importorskip("safetensors")
    torch.manual_seed(1)
    _save_hf_style(tmp_path, Tied(), {})
    (missing, unexpected, ref_sd, got, n, ref_n), _ = run(2, _pretrained_case, str(tmp_path), True)
    assert missing == [] and unexpected == []
    assert list(got) == list(ref_sd)
    assert all(torch.equal(got[k], ref_sd[k]) for k in ref_sd)  # bitwise: the same bytes
    assert n == ref_n == 13 * 5 + 5 + 5 + 1


def test_load_pretrained_reports_missing_and_unexpected_keys(tmp_path):
    pytest.importorskip("safetensors")
    torch.manual_seed(1)
    ref = Tied()
    _save_hf_style(tmp_path, ref, {"extra.weight": torch.ones(2)})
    (tmp_path / "model.safetensors.index.json").unlink()  # every *.safetensors of the folder
    with pytest.raises(Exception, match=r"unexpected keys \['extra.weight'\]"):
        run(2, _pretrained_case, str(tmp_path), True)
    missing, unexpected = run(2, _pretrained_case, str(tmp_path), False)[0][:2]
    assert missing == [] and unexpected == ["extra.weight"]


def test_covering_rows_is_the_smallest_read():
    from hypothesis import given, strategies as st
    from parts.partition.interop.slices import covering_rows

    @given(st.lists(st.integers(1, 5), min_size=1, max_size=3), st.data())
    def check(shape, data):
        import math
        numel = math.prod(shape)
        start = data.draw(st.integers(0, numel))
        stop = data.draw(st.integers(start, numel))
        first, last, offset = covering_rows(shape, start, stop)
        row = numel // shape[0]
        if stop > start:
            assert first * row <= start and stop <= last * row  # covers the range
            assert (first + 1) * row > start and (last - 1) * row < stop  # and no more
            assert offset == start - first * row
        else:
            assert (first, last) == (0, 0)
    check()


def _replace_data_case() -> str:
    _, model = make_pair(GPT)
    attach(model)
    try:
        model.wte.weight.data = torch.zeros(VOCAB + 3, 24)  # what resize_token_embeddings does
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_replacing_a_sharded_params_data_by_another_shape_raises():
    for message in run(2, _replace_data_case):
        assert "parameter 'wte.weight' (53, 24)" in message and "(56, 24)" in message, message
