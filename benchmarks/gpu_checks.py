"""The correctness stages of ``gpu_check.py``: each a function of a ``Context`` returning its checks.

Every check compares `parts` against a reference on the same seeds: plain one-device training,
FSDP2 ``fully_shard``, training in memory, or the run before a checkpoint. A stage runs on a
world-1 process group (NCCL on a GPU, gloo on the CPU), except ``pair`` (two gloo ranks on one
device). ``Context`` says the mode, the device and the model sizes; CPU mode uses tiny ones.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
from gpt_model import GPT, GPTConfig  # noqa: E402


@dataclass
class Context:
    """Where a stage runs: ``mode`` ``cpu`` or ``cuda``, and a scratch directory."""

    mode: str
    scratch: str
    checks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        """The compute device (every rank of the check on the one GPU)."""
        return torch.device("cuda", 0) if self.mode == "cuda" else torch.device("cpu")

    @property
    def backend(self) -> str:
        """The world-1 backend: NCCL on a GPU, gloo on the CPU."""
        return "nccl" if self.mode == "cuda" else "gloo"

    def config(self, dropout: float = 0.0) -> GPTConfig:
        """The small GPT every correctness check trains."""
        if self.mode == "cuda":
            return GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256, dropout=dropout)
        return GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=dropout)

    def record(self, name: str, status: str, detail: str, **metrics: Any) -> None:
        """One check's result (``PASS``, ``FAIL``, ``SKIP`` or ``INFO`` for a measurement)."""
        self.checks.append({"check": name, "status": status, "detail": detail, **metrics})

    def expect(self, name: str, ok: bool, detail: str, **metrics: Any) -> None:
        """A check that passes exactly when ``ok``."""
        self.record(name, "PASS" if ok else "FAIL", detail, **metrics)

    @contextlib.contextmanager
    def guard(self, name: str) -> Iterator[None]:
        """Run one check's body; an exception is that check's FAIL, with where it was raised."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - one check failing must not stop the others
            frames = traceback.extract_tb(exc.__traceback__)[-3:]
            where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames))
            self.record(name, "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                                      f" [at {where}]")


def world1(ctx: Context) -> None:
    """Start a world-1 process group on the context's backend, unless one exists (the tests' harness)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if ctx.mode == "cuda":
        torch.cuda.set_device(ctx.device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=ctx.device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def deterministic(ctx: Context) -> Iterator[None]:
    """Kernels that give the same bits run to run, so sharded and plain runs can be equal bitwise
    (the settings before are restored after)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # the comparisons judge the bits
    if ctx.mode == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.enable_flash_sdp(False)  # its backward and the memory-efficient one's
        torch.backends.cuda.enable_mem_efficient_sdp(False)  # are not deterministic: the math kernel
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def batches(ctx: Context, config: GPTConfig, steps: int, rows: int, seed: int, rank: int = 0) -> list:
    """``steps`` (inputs, targets) pairs on the device, drawn on the CPU from ``seed`` and ``rank``."""
    g = torch.Generator().manual_seed(seed + 1000 * rank)
    out = []
    for _ in range(steps):
        x = torch.randint(0, config.vocab_size, (rows, config.block_size + 1), generator=g)
        out.append((x[:, :-1].contiguous().to(ctx.device), x[:, 1:].contiguous().to(ctx.device)))
    return out


def plain(ctx: Context, config: GPTConfig, dtype: torch.dtype = torch.float32, **kw: Any) -> GPT:
    """The reference: an unsharded GPT from seed 0, on the device."""
    torch.manual_seed(0)
    return GPT(config, **kw).to(ctx.device, dtype)


def sharded(ctx: Context, config: GPTConfig, remote: Any = None, dtype: Optional[torch.dtype] = None,
            **kw: Any) -> GPT:
    """The same GPT built under ``partitioned`` from seed 0, computing on the device."""
    from parts.partition import partitioned
    torch.manual_seed(0)
    with partitioned(device=ctx.device, remote_device=remote, dtype=dtype):
        return GPT(config, **kw)


def adamw(params: Any) -> torch.optim.Optimizer:
    """The optimizer every check steps."""
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def train(model: Any, opt: Any, data: list, *, seed: Optional[int] = None,
          backward: Optional[Callable[[torch.Tensor], None]] = None) -> list[torch.Tensor]:
    """One step per batch; the losses (detached). ``seed``: reseed before each step (dropout)."""
    losses = []
    for k, (x, y) in enumerate(data):
        if seed is not None:
            torch.manual_seed(seed + k)
        loss = model(x, y)
        (backward or torch.Tensor.backward)(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    return losses


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bitwise equal lists of tensors."""
    return len(a) == len(b) and all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


def same_weights(model: Any, reference: torch.nn.Module) -> bool:
    """The sharded model's full weights bitwise equal to the plain model's."""
    from parts.partition import full_state_dict
    got, want = full_state_dict(model), reference.state_dict()
    return sorted(got) == sorted(want) and all(torch.equal(got[k].cpu(), want[k].cpu()) for k in want)


def rel_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest relative difference between two loss curves."""
    return max(abs(x.item() - y.item()) / max(abs(y.item()), 1e-12) for x, y in zip(a, b))


# ------------------------------------------------------------------ stage w1
def equivalence(ctx: Context) -> None:
    """fp32, deterministic kernels: sharded training equals plain training bitwise (losses, weights)."""
    from parts.partition import attach, shards
    config = ctx.config()
    data = batches(ctx, config, 3, 4, seed=1)
    ref = plain(ctx, config)
    ref_losses = train(ref, adamw(ref.parameters()), data)
    for tag, knobs in (("per_module", {"persistence_threshold": 0}), ("default_knobs", {})):
        with ctx.guard(f"equivalence.{tag}"):
            model = sharded(ctx, config)
            attach(model, **knobs)
            losses = train(model, adamw(shards(model)), data)
            ok = same(losses, ref_losses) and same_weights(model, ref)
            devices = sorted({str(s.device) for s in shards(model)})
            ctx.expect(f"equivalence.{tag}", ok and devices == [str(ctx.device)],
                       f"losses and weights bitwise equal to plain training: {ok}; shards on {devices}",
                       last_loss=losses[-1].item())


def mixed_precision(ctx: Context) -> None:
    """bf16 compute, fp32 masters and reduction: parts' MixedPrecision against FSDP2's policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from parts.partition import MixedPrecision, attach, shards
    config = ctx.config()
    data = batches(ctx, config, 4, 4, seed=2)
    model = sharded(ctx, config)
    attach(model, mixed_precision=MixedPrecision())
    ours = train(model, adamw(shards(model)), data)
    fsdp = plain(ctx, config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in fsdp.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(fsdp, mp_policy=policy)
    theirs = train(fsdp, adamw(fsdp.parameters()), data)
    gap = rel_gap(ours, theirs)
    # both compute in bf16 from fp32 masters; the cast points differ, so bf16 rounding (2^-8) bounds it
    ctx.expect("mixed_precision.vs_fsdp2", gap <= 1e-2,
               f"largest relative loss difference {gap:.2e} over {len(data)} steps (tolerance 1e-2)", gap=gap)


def checkpoint_rng(ctx: Context) -> None:
    """Dropout under activation checkpointing: the recompute replays the device RNG exactly."""
    from parts.checkpoint import checkpoint
    from parts.partition import attach, shards
    config = ctx.config(dropout=0.1)
    data = batches(ctx, config, 3, 4, seed=3)
    runs = {}
    for tag, fn in (("plain", None), ("checkpointed", checkpoint)):
        model = sharded(ctx, config, checkpoint_fn=fn)
        attach(model)
        losses = train(model, adamw(shards(model)), data, seed=77)
        states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state(ctx.device)] if ctx.mode == "cuda" else [])
        runs[tag] = (losses, states)
    ok = same(runs["plain"][0], runs["checkpointed"][0])
    rng = same(runs["plain"][1], runs["checkpointed"][1])
    ctx.expect("checkpoint_rng.dropout_replayed", ok and rng,
               f"losses with and without checkpointing bitwise equal: {ok}; RNG state after equal: {rng}")


def dcp_resume(ctx: Context) -> None:
    """A DCP checkpoint after 2 steps, loaded into a fresh model: the next steps equal the uninterrupted run."""
    from parts.comm import dcp
    from parts.partition import (attach, load_sharded_optimizer_state_dict, load_sharded_state_dict, shards,
                                 sharded_optimizer_state_dict, sharded_state_dict)
    config = ctx.config()
    data = batches(ctx, config, 4, 4, seed=4)

    def build() -> tuple:
        m = sharded(ctx, config)
        attach(m)
        return m, adamw(shards(m))
    model, opt = build()
    train(model, opt, data[:2])
    path = os.path.join(tempfile.mkdtemp(dir=ctx.scratch), "ck")
    dcp.save({"model": sharded_state_dict(model), "optimizer": sharded_optimizer_state_dict(model, opt)},
             checkpoint_id=path)
    straight = train(model, opt, data[2:])
    again, opt2 = build()
    state = {"model": sharded_state_dict(again), "optimizer": sharded_optimizer_state_dict(again, opt2)}
    dcp.load(state, checkpoint_id=path)
    load_sharded_state_dict(again, state["model"])
    load_sharded_optimizer_state_dict(again, opt2, state["optimizer"])
    resumed = train(again, opt2, data[2:])
    ctx.expect("dcp_resume.bitwise", same(resumed, straight),
               "the 2 steps after loading equal the uninterrupted run bitwise")


def sync_count(ctx: Context) -> None:
    """Host synchronisations per phase of a warmed-up parts step (``torch.cuda.set_sync_debug_mode``)."""
    if ctx.mode != "cuda":
        ctx.record("sync_count", "SKIP", "host syncs are counted on CUDA only (set_sync_debug_mode)")
        return
    from parts.partition import MixedPrecision, attach, shards
    config = ctx.config()
    data = batches(ctx, config, 3, 4, seed=5)
    model = sharded(ctx, config)
    attach(model, mixed_precision=MixedPrecision(), persistence_threshold=0)
    opt = adamw(shards(model))
    train(model, opt, data[:2])  # traces recorded, buffers allocated
    x, y = data[2]
    state: dict[str, Any] = {}
    phases = {"forward": lambda: state.update(loss=model(x, y)), "backward": lambda: state["loss"].backward(),
              "step": lambda: (opt.step(), opt.zero_grad(set_to_none=True))}
    counts = {}
    for phase, fn in phases.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        counts[phase] = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
    ctx.record("sync_count", "INFO", ", ".join(f"{k} {v}" for k, v in counts.items()),
               **{f"syncs_{k}": v for k, v in counts.items()})


def stage_w1(ctx: Context) -> None:
    """World-1 equivalence on the device: plain, FSDP2, checkpoint RNG, DCP resume, host syncs."""
    world1(ctx)
    with deterministic(ctx):
        for name, fn in (("equivalence", equivalence), ("mixed_precision", mixed_precision),
                         ("checkpoint_rng", checkpoint_rng), ("dcp_resume", dcp_resume), ("sync_count", sync_count)):
            with ctx.guard(name):
                fn(ctx)


# ------------------------------------------------------------------ stage offload
@contextlib.contextmanager
def counted_copies() -> Iterator[dict[str, int]]:
    """Counts of the staging layer's device copies (device-to-host, host-to-device) inside."""
    from parts.offload.staging import staging
    counts = {"d2h": 0, "h2d": 0}
    streams = staging.streams
    real = streams.d2h, streams.h2d

    def d2h(*a: Any) -> Any:
        counts["d2h"] += 1
        return real[0](*a)

    def h2d(*a: Any) -> Any:
        counts["h2d"] += 1
        return real[1](*a)
    streams.d2h, streams.h2d = d2h, h2d
    try:
        yield counts
    finally:
        del streams.d2h, streams.h2d


def offload(ctx: Context) -> None:
    """Shards in host memory and shards with AdamW state on disk (stepped after and during backward),
    compute on the device. The optimizer then steps on the CPU: shards in host memory match training
    in device memory to the rounding of the CPU's and the GPU's AdamW kernels (bitwise on the CPU),
    and the disk runs equal them bitwise (the same CPU steps, through pinned staging copies on a GPU)."""
    from parts.offload import DiskStore, OffloadedOptimizer
    from parts.partition import attach, meta, shards
    config = ctx.config()
    data = batches(ctx, config, 3, 4, seed=6)
    mem = sharded(ctx, config)
    attach(mem)
    in_device = train(mem, adamw(shards(mem)), data)
    with ctx.guard("offload.host_memory"):
        model = sharded(ctx, config, remote="cpu")
        attach(model)
        ref = train(model, adamw(shards(model)), data)
        pinned = all(meta(p).shard.is_pinned() for p in model.parameters()) if ctx.mode == "cuda" else True
        gap, tol = rel_gap(ref, in_device), (1e-4 if ctx.mode == "cuda" else 0.0)
        ctx.expect("offload.host_memory", gap <= tol and pinned,
                   f"partitioned(remote_device='cpu'): losses within {tol:g} (relative) of training in device "
                   f"memory: {gap:.1e}; shards pinned: {pinned if ctx.mode == 'cuda' else 'n/a on the CPU'}", gap=gap)
    for mode in ("after_backward", "in_backward"):
        with ctx.guard(f"offload.disk_{mode}"), counted_copies() as copies:
            store = DiskStore(tempfile.mkdtemp(dir=ctx.scratch), memory_budget=1 << 30)
            try:
                model = sharded(ctx, config, remote=store)
                attach(model)
                opt = OffloadedOptimizer(adamw(shards(model)), store)

                def in_backward(loss: torch.Tensor) -> None:
                    with opt.step_in_backward():
                        loss.backward()
                losses = train(model, opt, data, backward=in_backward if mode == "in_backward" else None)
                opt.settle()
            finally:
                store.close()
            staged = copies["d2h"] > 0 and copies["h2d"] > 0 if ctx.mode == "cuda" else copies == {"d2h": 0, "h2d": 0}
            ctx.expect(f"offload.disk_{mode}", same(losses, ref) and staged,
                       f"losses bitwise equal to shards in host memory: {same(losses, ref)}; staging copies "
                       f"{copies} ({'pinned, on side streams' if ctx.mode == 'cuda' else 'none on the CPU'})")


def stage_offload(ctx: Context) -> None:
    """Offload with compute on the device (world 1)."""
    world1(ctx)
    with deterministic(ctx), ctx.guard("offload"):
        offload(ctx)
