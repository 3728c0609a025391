"""The stages of ``gpu_check.py`` beyond world-1 equivalence: two ranks on one device, one step of a
~1B GPT (plain, parts, FSDP2), and a run whose model states exceed the device memory it may use."""

from __future__ import annotations

import contextlib
import resource
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from gpu_checks import GPT, Context, GPTConfig, adamw, batches, plain, rel_gap, sharded, train, world1

GiB = 2**30


# ------------------------------------------------------------------ stage pair (two gloo ranks, one device)
def _nccl_path() -> Callable[[], Any]:
    """The switch that makes parts use torch's flat collectives (NCCL's code path) on gloo, or None."""
    try:
        from parts.comm.device import torch_algorithms  # type: ignore[attr-defined]
    except ImportError:
        return None
    return torch_algorithms


def sgd(params: Any) -> torch.optim.Optimizer:
    """Plain SGD: rounding differences between two runs pass into the weights unamplified."""
    return torch.optim.SGD(params, lr=0.05)


def stage_pair(ctx: Context) -> None:
    """Two gloo ranks on the one device: parts at world 2 against one process training the
    concatenated batch (gloo's own algorithms on the CPU only: its send/recv refuses CUDA tensors)."""
    from parts.partition import attach, full_state_dict, shards
    if ctx.mode == "cuda":
        torch.cuda.set_device(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = ctx.config()
    mine = batches(ctx, config, 3, 2, seed=7, rank=rank)
    every = [batches(ctx, config, 3, 2, seed=7, rank=r) for r in range(world)]
    full = [(torch.cat([b[k][0] for b in every]), torch.cat([b[k][1] for b in every])) for k in range(3)]
    ref = plain(ctx, config)
    ref_losses = train(ref, sgd(ref.parameters()), full)
    paths: dict[str, Any] = {"nccl_path": _nccl_path()}
    if ctx.mode == "cpu":
        paths["gloo_path"] = contextlib.nullcontext
    for name, switch in paths.items():
        if switch is None:
            ctx.record(f"pair.{name}", "SKIP", "not available: this checkout has no switch to the NCCL code "
                                               "path (parts.comm.device.torch_algorithms)")
            continue
        with ctx.guard(f"pair.{name}"), switch():
            model = sharded(ctx, config)
            attach(model)
            losses = torch.stack(train(model, sgd(shards(model)), mine)).cpu()
            dist.all_reduce(losses)  # on the CPU: the mean over ranks of each step's loss
            gap = rel_gap(list(losses / world), ref_losses)
            weights = full_state_dict(model, rank0_only=False)
            wgap = max((weights[k] - v).abs().max().item() for k, v in ref.state_dict().items())
            # fp32: only the order of the sums differs from the single process (rounding, ~1e-7
            # relative); SGD passes it on unamplified (Adam's m / sqrt(v) would not, for tiny grads)
            ctx.expect(f"pair.{name}", gap <= 1e-5 and wgap <= 1e-6,
                       f"world {world} on {ctx.device.type}: loss rel diff {gap:.1e} (tolerance 1e-5), weights "
                       f"max abs diff {wgap:.1e} (tolerance 1e-6) against one process", gap=gap, weight_gap=wgap)


# ------------------------------------------------------------------ stage perf (one variant per process)
def big_config(ctx: Context) -> GPTConfig:
    """The ~1B GPT on a GPU (18 x 2048 wide, 32768 tokens: 0.98B parameters); tiny on the CPU."""
    if ctx.mode == "cuda":
        return GPTConfig(vocab_size=32768, block_size=1024, n_layer=18, n_head=16, n_embd=2048)
    return GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64)


def _build(ctx: Context, variant: str, config: GPTConfig) -> tuple[torch.nn.Module, Any, Any]:
    """(model, optimizer, autocast context) of one variant, bf16 compute and fp32 masters in all three."""
    if variant == "parts":
        from parts.partition import MixedPrecision, attach, shards
        model = sharded(ctx, config)
        attach(model, mixed_precision=MixedPrecision())
        return model, adamw(shards(model)), contextlib.nullcontext()
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = GPT(config)
    if variant == "plain":
        return model, adamw(model.parameters()), torch.autocast(ctx.device.type, dtype=torch.bfloat16)
    if variant != "fsdp2":
        raise SystemExit(f"perf: unknown variant {variant!r} (plain, parts, fsdp2)")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, adamw(model.parameters()), contextlib.nullcontext()


def _count(config: GPTConfig) -> int:
    """Parameters of a GPT of ``config`` (built on the meta device: no memory, no init)."""
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(config).parameters())


def _sync(ctx: Context) -> None:
    if ctx.mode == "cuda":
        torch.cuda.synchronize()


def _peak_gib(ctx: Context) -> float:
    if ctx.mode == "cuda":
        return torch.cuda.max_memory_allocated() / GiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def stage_perf(ctx: Context, variant: str) -> None:
    """Median step time and peak memory of one variant at world 1 (bf16 compute, fp32 AdamW)."""
    world1(ctx)
    config = big_config(ctx)
    warm, timed = (2, 3) if ctx.mode == "cuda" else (1, 2)
    data = batches(ctx, config, warm + timed, 4 if ctx.mode == "cuda" else 2, seed=8)
    if ctx.mode == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model, opt, autocast = _build(ctx, variant, config)
    _sync(ctx)
    built = time.perf_counter() - start
    times, losses = [], []
    for k, (x, y) in enumerate(data):
        _sync(ctx)
        t = time.perf_counter()
        with autocast:
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(ctx)
        if k >= warm:
            times.append(time.perf_counter() - t)
        losses.append(loss.item())
    step_ms = 1000 * sorted(times)[len(times) // 2]
    params = _count(config)
    finite = all(v == v and abs(v) != float("inf") for v in losses)
    memory = "peak allocated GiB" if ctx.mode == "cuda" else "peak RSS GiB"
    ctx.record(f"perf.{variant}", "INFO" if finite else "FAIL",
               f"{params:,} params, median step {step_ms:.1f} ms, {memory} {_peak_gib(ctx):.2f}, "
               f"built in {built:.1f} s, losses {losses[0]:.3f} -> {losses[-1]:.3f}",
               variant=variant, params=params, step_ms=round(step_ms, 1), peak_gib=round(_peak_gib(ctx), 2))


# ------------------------------------------------------------------ stage beyond (states > the GPU memory allowed)
def beyond_config(ctx: Context) -> GPTConfig:
    """A 336M GPT on a GPU (fp32 AdamW states 5.4 GB); tiny on the CPU."""
    if ctx.mode == "cuda":
        return GPTConfig(vocab_size=32768, block_size=512, n_layer=24, n_head=16, n_embd=1024)
    return GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64)


def stage_beyond(ctx: Context, cap_gib: float = 2.0) -> None:
    """One device, GPU memory capped below the model states (``set_per_process_memory_fraction``):
    shards and AdamW state on disk, stepped during backward; the loss on a repeated batch falls."""
    from parts.offload import DiskStore, OffloadedOptimizer
    from parts.partition import attach, shards
    world1(ctx)
    config = beyond_config(ctx)
    params = _count(config)
    states = 16 * params  # fp32 values, grads and AdamW's two moments
    if ctx.mode == "cuda":
        torch.cuda.set_per_process_memory_fraction(cap_gib * GiB / torch.cuda.get_device_properties(0).total_memory)
        torch.cuda.reset_peak_memory_stats()
    store = DiskStore(tempfile.mkdtemp(dir=ctx.scratch))
    try:
        model = sharded(ctx, config, remote=store)
        layer = 12 * config.n_embd ** 2
        attach(model, prefetch_bucket_size=layer, max_live_parameters=2 * layer, max_reuse_distance=0,
               persistence_threshold=4 * config.n_embd)
        lr = 1e-5 * (28 * 1024) / (config.n_layer * config.n_embd)  # train_offload.py's lr_for
        opt = OffloadedOptimizer(torch.optim.AdamW(shards(model), lr=lr, weight_decay=0.0), store)

        def in_backward(loss: torch.Tensor) -> None:
            with opt.step_in_backward():
                loss.backward()
        start = time.perf_counter()
        losses = train(model, opt, batches(ctx, config, 1, 2, seed=9) * 2, backward=in_backward)
        seconds = (time.perf_counter() - start) / 2
    finally:
        store.close()
    peak = torch.cuda.max_memory_allocated() / GiB if ctx.mode == "cuda" else None
    falls = losses[-1].item() < losses[0].item()
    within = peak is None or (peak <= cap_gib and states > cap_gib * GiB)
    where = (f"peak allocated {peak:.2f} GiB under a cap of {cap_gib} GiB" if peak is not None
             else "no GPU memory cap on the CPU")
    ctx.expect("beyond.states_exceed_device_memory", falls and within,
               f"{params:,} params, model states {states / GiB:.1f} GiB; {where}; loss on a repeated "
               f"batch {losses[0].item():.4f} -> {losses[-1].item():.4f}; {seconds:.1f} s per step",
               params=params, states_gib=round(states / GiB, 2), cap_gib=cap_gib if peak is not None else None,
               peak_gib=None if peak is None else round(peak, 2), step_s=round(seconds, 2))
