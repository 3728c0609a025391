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
