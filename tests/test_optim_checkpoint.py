"""BF16Optimizer checkpoints: save at world N, load at world M, resume bitwise."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run

from parts.optim import BF16Optimizer

KEYS = ("exp_avg", "exp_avg_sq", "step")


def build(step_chunk: int = 48):
    """Seeded bf16 MLP, AdamW (two groups, different hyperparameters), StepLR."""
    torch.manual_seed(99)
    model = torch.nn.Sequential(torch.nn.Linear(9, 11), torch.nn.Tanh(), torch.nn.Linear(11, 3))
    model = model.to(torch.bfloat16)
    p = list(model.parameters())
    inner = torch.optim.AdamW([{"params": p[:2]}, {"params": p[2:], "lr": 5e-3,
                                                   "weight_decay": 0.0}], lr=1e-2)
    opt = BF16Optimizer(inner, allgather_bucket_size=100, step_chunk=step_chunk,
                        named_parameters=model.named_parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def train(model, opt, sched, steps: range) -> list[float]:
    """Every rank sees the same batch: the mean of equal bf16 grads is exact, so the trajectory
    does not depend on the world size and resumed runs can be compared bitwise."""
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(8, 9, generator=gen).to(torch.bfloat16)
        loss = F.mse_loss(model(x).float(), torch.randn(8, 3, generator=gen))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def snapshot(model, opt) -> dict:
    """Full fp32 masters and per-element states of every parameter (collectives)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = opt.full_fp32_param(p)
        for key in KEYS:
            out[f"{name}/{key}"] = opt.full_state(p, key)
    return out


def roundtrip(obj):
    """torch.save then torch.load(weights_only=True)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def save_body(k: int, j: int, consolidated: bool):
    """Train k steps, checkpoint, then continue j steps (the uninterrupted run)."""
    model, opt, sched = build()
    losses = train(model, opt, sched, range(k))
    sd = opt.consolidated_state_dict() if consolidated else opt.state_dict()
    sched_sd = sched.state_dict()
    snap = snapshot(model, opt)
    more = train(model, opt, sched, range(k, k + j))
    return roundtrip(sd), sched_sd, snap, losses + more


def load_body(sds, sched_sd, k: int, j: int):
    """Load at this world size, snapshot, and train the remaining j steps."""
    model, opt, sched = build(step_chunk=80)  # another chunking of the masters than at save
    opt.load_state_dict(roundtrip(sds))
    sched.load_state_dict(sched_sd)
    snap = snapshot(model, opt)
    return snap, train(model, opt, sched, range(k, k + j))


def own_rank_body(sds, k: int, j: int):
    """Same world size: each rank loads only its own saved dict."""
    model, opt, sched = build()
    opt.load_state_dict(roundtrip(sds[dist.get_rank()]))
    return snapshot(model, opt)


def test_same_world_loads_own_dict_only() -> None:
    """At an unchanged world size a rank needs only its own dict."""
    saved = run(3, save_body, 3, 0, False)
    for snap in run(3, own_rank_body, [s[0] for s in saved], 3, 0):
        assert all(torch.equal(snap[key], value) for key, value in saved[0][2].items())


@pytest.mark.parametrize("consolidated", [False, True])
@pytest.mark.parametrize("n,m", [(2, 1), (2, 3), (4, 2), (1, 4)])
def test_reshard_resume_bitwise(n: int, m: int, consolidated: bool) -> None:
    """Masters and states equal bitwise after N->M; resumed losses equal uninterrupted ones."""
    k, j = 4, 4
    saved = run(n, save_body, k, j, consolidated)
    sds = saved[0][0] if consolidated else [s[0] for s in saved]
    if consolidated:
        assert all(s[0] is None for s in saved[1:])
    loaded = run(m, load_body, sds, saved[0][1], k, j)
    for snap, losses in loaded:
        assert snap.keys() == saved[0][2].keys()
        for key, value in saved[0][2].items():
            assert torch.equal(snap[key], value), key
        assert losses == saved[0][3][k:]


def test_state_dict_contents_and_errors() -> None:
    """Names, shapes, world size and options are in the dict; wrong input gets clear errors."""
    sds = [s[0] for s in run(2, save_body, 2, 0, False)]
    sd = sds[0]
    assert sd["world_size"] == 2 and [m["name"] for m in sd["params"]] == [
        "0.weight", "0.bias", "2.weight", "2.bias"]
    assert [m["shape"] for m in sd["params"]] == [[11, 9], [11], [3, 11], [3]]
    assert sd["param_groups"][1]["lr"] == 5e-3 and sd["param_groups"][1]["weight_decay"] == 0.0
    model, opt, _ = build()
    with pytest.raises(ValueError, match="needs the state dict of saved rank 1 of 2"):
        opt.load_state_dict(sds[:1])
    bad = roundtrip(sds)
    for s in bad:
        s["params"][0]["shape"] = [9, 11]
    with pytest.raises(ValueError, match="'0.weight'"):
        opt.load_state_dict(bad)


# ------------------------------------------------- strict names and dtypes (one process)
def trained(shapes: dict) -> tuple[BF16Optimizer, dict]:
    """AdamW over seeded bf16 params named by ``shapes``, after one step."""
    torch.manual_seed(5)
    named = {n: torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for n, s in shapes.items()}
    opt = BF16Optimizer(torch.optim.AdamW(list(named.values()), lr=1e-2),
                        named_parameters=named)
    sum((p.float() ** 2).sum() for p in named.values()).backward()
    opt.step()
    opt.zero_grad()
    return opt, named


def local_snapshot(opt: BF16Optimizer, named: dict) -> dict:
    return {f"{n}/{k}": (opt.full_fp32_param(p) if k is None else opt.full_state(p, k))
            for n, p in named.items() for k in (None,) + KEYS}


def fresh_a() -> tuple[BF16Optimizer, dict]:
    """An untrained optimizer over one parameter 'a' (other values than ``trained``'s)."""
    torch.manual_seed(6)
    a = torch.nn.Parameter(torch.randn(5).to(torch.bfloat16))
    return BF16Optimizer(torch.optim.AdamW([a], lr=1e-2), named_parameters=[("a", a)]), {"a": a}


@pytest.mark.parametrize("consolidated", [False, True])
def test_unexpected_saved_param_raises_unless_not_strict(consolidated: bool) -> None:
    """'b' saved before 'a' (so 'a' sits at offset 3 of the saved group): strict raises
    naming 'b' and leaves the target untouched; strict=False loads 'a' bitwise."""
    saved, named = trained({"b": (3,), "a": (5,)})
    sd = saved.consolidated_state_dict() if consolidated else saved.state_dict()
    target, tnamed = fresh_a()
    before = target.full_fp32_param(tnamed["a"])
    with pytest.raises(ValueError, match=r"does not: \['b'\].*strict=False"):
        target.load_state_dict(roundtrip(sd))
    assert torch.equal(target.full_fp32_param(tnamed["a"]), before) and not target.state
    target.load_state_dict(roundtrip(sd), strict=False)
    want = local_snapshot(saved, {"a": named["a"]})
    got = local_snapshot(target, tnamed)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def _cast(sd: dict, key, dtype: torch.dtype) -> dict:
    """``sd`` (consolidated) with the master (``key`` None) or state ``key`` of 'a' cast."""
    sd = roundtrip(sd)
    if key is None:
        sd["master"]["a"] = sd["master"]["a"].to(dtype)
    elif key in sd["state"]["a"]:
        sd["state"]["a"][key] = sd["state"]["a"][key].to(dtype)
    else:
        sd["scalars"]["a"][key] = sd["scalars"]["a"][key].to(dtype)
    return sd


@pytest.mark.parametrize("key,dtype", [(None, torch.int64), ("exp_avg", torch.int32),
                                       ("exp_avg_sq", torch.bool), ("step", torch.bool)])
def test_non_floating_master_or_state_raises_naming_key_and_dtypes(key, dtype) -> None:
    saved, _ = trained({"a": (5,)})
    target, tnamed = fresh_a()
    before = target.full_fp32_param(tnamed["a"])
    what = "fp32 master" if key is None else f"state '{key}'"
    with pytest.raises(ValueError, match=rf"parameter 'a': {what} is {dtype}"):
        target.load_state_dict(_cast(saved.consolidated_state_dict(), key, dtype))
    assert torch.equal(target.full_fp32_param(tnamed["a"]), before) and not target.state


def test_rank_dict_dtype_error_names_the_group_params() -> None:
    saved, _ = trained({"a": (5,)})
    sd = roundtrip(saved.state_dict())
    sd["groups"][0]["state"]["exp_avg"] = sd["groups"][0]["state"]["exp_avg"].to(torch.int64)
    with pytest.raises(ValueError, match=r"param group 0 \('a'\) of saved rank 0: state 'exp_avg' "
                                         r"is torch.int64, expected torch.float32"):
        fresh_a()[0].load_state_dict(sd)


def test_integer_step_and_bf16_state_load_and_train_on() -> None:
    """An int64 step counter loads as saved and the next step equals the one from the float-step
    checkpoint (the bias corrections read the same count); a bf16 exp_avg loads widened to fp32
    (exact), equal to the saved values rounded to bf16."""
    saved, _ = trained({"a": (5,)})
    sd = saved.consolidated_state_dict()
    after = []
    for dtype in (torch.float32, torch.int64):
        target, tnamed = fresh_a()
        target.load_state_dict(_cast(sd, "step", dtype))
        step = target.full_state(tnamed["a"], "step")
        assert step.dtype == dtype and float(step) == 1.0
        (tnamed["a"].float() ** 2).sum().backward()
        target.step()
        after.append(target.full_fp32_param(tnamed["a"]))
    assert torch.equal(after[0], after[1])
    target, tnamed = fresh_a()
    target.load_state_dict(_cast(sd, "exp_avg", torch.bfloat16))
    want = sd["state"]["a"]["exp_avg"].to(torch.bfloat16).float()
    assert not torch.equal(want, sd["state"]["a"]["exp_avg"])  # the cast did change values
    got = target.full_state(tnamed["a"], "exp_avg")
    assert got.dtype == torch.float32 and torch.equal(got, want)
