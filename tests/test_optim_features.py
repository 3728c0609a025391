"""BF16Optimizer: LR schedulers, fp32 grad accumulation, memory by storage accounting, fp16 scaling."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run

from parts.optim import BF16Optimizer, DynamicLossScaler


def mlp(dtype=torch.bfloat16) -> torch.nn.Module:
    """Seeded tiny MLP with uneven sizes."""
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(),
                               torch.nn.Linear(10, 3)).to(dtype)


SCHEDULERS = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=8),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_lr_schedulers_drive_the_wrapped_optimizer(name: str) -> None:
    """Schedulers accept the wrapper; lr (and momentum) follow the plain optimizer's sequence,
    and SGD's update uses the scheduled lr."""
    plain_model, model = mlp(torch.float32), mlp()
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.05, momentum=0.9)
    opt = BF16Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    s_plain, s_wrapped = SCHEDULERS[name](plain), SCHEDULERS[name](opt)
    x = torch.randn(4, 6)
    for _ in range(6):
        for o, m in ((plain, plain_model), (opt, model)):
            m(x.to(next(m.parameters()).dtype)).float().sum().backward()
            o.step()
            o.zero_grad()
        s_plain.step()
        s_wrapped.step()
        assert opt.param_groups[0]["lr"] == plain.param_groups[0]["lr"]
        assert opt.optimizer.param_groups[0]["momentum"] == plain.param_groups[0]["momentum"]
    assert s_wrapped.get_last_lr() == s_plain.get_last_lr()


def test_sgd_update_uses_scheduled_lr() -> None:
    """After a scheduler halves lr, plain SGD moves the master by exactly lr * grad."""
    model = mlp()
    opt = BF16Optimizer(torch.optim.SGD(model.parameters(), lr=0.25))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = torch.randn(4, 6).to(torch.bfloat16)
    for lr in (0.25, 0.125):
        model(x).float().sum().backward()
        before = opt.flat_groups[0].master.clone()
        grad = opt.flat_groups[0].grad.clone()
        opt.step()
        sched.step()
        opt.zero_grad()
        torch.testing.assert_close(opt.flat_groups[0].master, before - lr * grad, rtol=0, atol=0)


def accumulate_body(micro: int):
    """k micro-batches accumulate into the fp32 buffer; bf16 grads are gone after each backward."""
    rank = dist.get_rank()
    model = mlp()
    opt = BF16Optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    expect = [torch.zeros(p.shape) for p in model.parameters()]
    leftovers = 0
    for i in range(micro):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * rank + i))
        out = model(x.to(torch.bfloat16)).float().pow(2).mean()
        grads = torch.autograd.grad(out, list(model.parameters()), retain_graph=True)
        for e, g in zip(expect, grads):
            e.add_(g.float())  # the fp32 sum of each micro-batch's bf16 grads
        out.backward()
        leftovers += sum(p.grad is not None for p in model.parameters())
    full = [opt.full_grad(p) for p in model.parameters()]
    mean = [e.clone() for e in expect]
    for m in mean:
        dist.all_reduce(m)
        m.div_(dist.get_world_size())
    return leftovers, all(torch.equal(a, b) for a, b in zip(full, mean))


@pytest.mark.parametrize("world", [1, 2])
def test_grad_accumulation_in_fp32(world: int) -> None:
    """4 micro-batches: buffer == fp32 sum of the bf16 grads, averaged across ranks (rank order of
    a 2-rank sum does not matter); no bf16 .grad outlives backward."""
    assert run(world, accumulate_body, 4) == [(0, True)] * world


def test_fp32_accumulation_keeps_small_grads() -> None:
    """Accumulating 256 grads of 1 on top of 256: bf16 would stall at 256, fp32 reaches 512."""
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
    opt = BF16Optimizer(torch.optim.SGD([p], lr=0.0))
    (p.float() * 256).sum().backward()
    for _ in range(256):
        p.float().sum().backward()
    assert opt.full_grad(p).item() == 512.0


def memory_body():
    """Storage bytes: fp32 master + state per rank, and the bf16 params stored once."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 33)).to(torch.bfloat16)
    opt = BF16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    model(torch.randn(2, 64).to(torch.bfloat16)).float().sum().backward()
    opt.step()
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    fg = opt.flat_groups[0]
    master_state = fg.master.untyped_storage().nbytes() + sum(
        v.untyped_storage().nbytes() for c in fg.master_chunks for v in opt.state[c].values())
    master_state -= 4 * (len(fg.master_chunks) - 1)  # one 4-byte step scalar per chunk
    psi = sum(p.numel() for p in model.parameters())
    return (len(storages), model[0].weight.untyped_storage().nbytes(), master_state,
            psi, fg.layout.padded_numel, world)


@pytest.mark.parametrize("world", [1, 3, 4])
def test_memory_storage_accounting(world: int) -> None:
    """Per rank (4 + K) * padded_numel / N bytes (K = 8 for AdamW, + 4 for the step scalar);
    one bf16 storage of 2 * padded bytes holds every param."""
    for storages, bf16_bytes, master_state, psi, padded, n in run(world, memory_body):
        assert storages == 1 and bf16_bytes == 2 * padded
        assert master_state == (4 + 8) * padded // n + 4
        assert padded - psi < 32 * n  # padding: under one alignment unit per rank


def fp16_body(overflow_rank: int, overflow_steps: list[int]):
    """fp16 params with a DynamicLossScaler; forced overflows on one rank skip on every rank."""
    rank = dist.get_rank()
    model = mlp(torch.float16)
    scaler = DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=2, hysteresis=2,
                               min_scale=2.0 ** 8)
    opt = BF16Optimizer(torch.optim.SGD(model.parameters(), lr=1e-2), loss_scaler=scaler)
    scales, skipped = [], []
    for step in range(7):
        before = [p.detach().clone() for p in model.parameters()]
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step)).half()
        loss = opt.scale_loss(model(x).float().pow(2).mean())
        if step in overflow_steps and rank == overflow_rank:
            loss = loss * 1e38  # fp16 grads overflow to inf
        loss.backward()
        opt.step()
        opt.zero_grad()
        scales.append(scaler.scale)
        skipped.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
    return scales, skipped, opt.skipped_steps


def test_fp16_dynamic_loss_scaling_agreed_across_ranks() -> None:
    """Overflow on rank 1 only: both ranks skip, back off after 2 overflows (hysteresis), grow after 2 clean steps."""
    out = run(2, fp16_body, 1, [1, 2, 3])
    scales, skipped, count = out[0]
    assert out[1] == out[0]
    assert skipped == [False, True, True, True, False, False, False]
    # 1024 -> (step 1 overflow, hysteresis 2 -> 1 left) 1024 -> (step 2) 512 -> (step 3) 512
    # -> (2 clean steps) 1024 -> 1024
    assert scales == [1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0, 1024.0]
    assert count == 3


def test_fp16_unscaled_update_matches_fp32_reference() -> None:
    """The scaled-and-unscaled SGD update equals lr * grad of the unscaled loss (scale 2^10 is exact)."""
    model = mlp(torch.float16)
    opt = BF16Optimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                        loss_scaler=DynamicLossScaler(init_scale=2.0 ** 10))
    x = torch.randn(4, 6).half()
    loss = model(x).float().pow(2).mean()
    grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    masters = [opt.full_fp32_param(p) for p in model.parameters()]
    opt.scale_loss(loss).backward()
    opt.step()
    for p, m, g in zip(model.parameters(), masters, grads):
        # fp16 grads of the scaled loss are the scaled fp16 grads up to fp16 rounding (rel 1e-3)
        torch.testing.assert_close(opt.full_fp32_param(p), m - 0.5 * g.float(), rtol=1e-3, atol=1e-4)


def test_loss_scaler_min_scale_and_state() -> None:
    """Backoff never goes under min_scale; state_dict round-trips."""
    s = DynamicLossScaler(init_scale=4.0, min_scale=2.0, backoff_factor=0.25)
    s.update(True)
    assert s.scale == 2.0
    s.update(True)
    assert s.scale == 2.0 and s.overflows == 2
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert vars(t) == vars(s)
    with pytest.raises(ValueError, match="hysteresis"):
        DynamicLossScaler(hysteresis=0)


def test_zero_grad_norm_is_a_noop_clip() -> None:
    """A zero grad norm with clipping on neither skips nor flips anything: SGD leaves params."""
    model = mlp()
    opt = BF16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), clip_grad=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    (model(torch.randn(2, 6).to(torch.bfloat16)).float().sum() * 0.0).backward()
    opt.step()
    assert opt.last_grad_norm == 0.0 and opt.skipped_steps == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def bf16_accum_body():
    """grad_accum_dtype=bfloat16: grads accumulate and reduce in bf16, the master still steps fp32."""
    rank = dist.get_rank()
    model = mlp()
    opt = BF16Optimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                        grad_accum_dtype=torch.bfloat16)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    grads = [opt.full_grad(p) for p in model.parameters()]
    masters = [opt.full_fp32_param(p) for p in model.parameters()]
    opt.step()
    after = [opt.full_fp32_param(p) for p in model.parameters()]
    return (opt.flat_groups[0].grad.dtype, opt.flat_groups[0].master.dtype,
            all(torch.equal(a, m - 0.5 * g.float()) for a, m, g in zip(after, masters, grads)))


def test_bf16_grad_accumulation_option() -> None:
    """The option is honoured at world 2: buffers and the reduction are bf16 (full_grad reduces
    the same way), the master and the SGD update are fp32: master - lr * grad exactly."""
    for grad_dtype, master_dtype, ok in run(2, bf16_accum_body):
        assert grad_dtype == torch.bfloat16 and master_dtype == torch.float32 and ok


def test_uninitialised_group_with_world_size_env_raises(monkeypatch) -> None:
    """WORLD_SIZE > 1 without a process group is an error, not a silent single-rank optimizer."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2"):
        BF16Optimizer(torch.optim.SGD(mlp().parameters(), lr=0.1))
