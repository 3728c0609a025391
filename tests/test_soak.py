"""Soak: 500 steps of a tiny GPT under partitioned + attach + AdamW(shards) at world 2, and the
main recipe's loop checked for memory kept per step.

Checked on every rank, every step: after the optimizer step no parameter is left gathered
(status NOT_AVAILABLE and a numel-0 ``p.data``) except the persistent ones (at most
``PERSISTENCE`` elements), which stay AVAILABLE; the number of hooks (module hooks and
post-accumulate-grad hooks) does not change; no full ``p.grad`` survives the reduce-scatter;
``stats()`` equals the previous step's (all fields but the step counter) once the trace
replays. RSS
(``parts.observe.snapshot``) is sampled every 10 steps; after a warm-up of ``WARMUP`` steps
its growth must stay below ``RSS_GROWTH_BOUND``.

Measured (2 cores, gloo, torch 2.13, fp32, RSS sampled every 10 steps after gc and
``malloc_trim``): about 274-281 MiB per rank at step 0; growth from step 100 to 500 of
2.0-3.0 MiB per rank over several runs, and in a 1000-step run +2.2 MiB for steps 100-500
then +0.15 MiB for steps 500-1000 (it levels off; no Python object type grew by more than
50 objects between steps 100 and 1500). Bound: 6 MiB. For scale, leaking one gathered
32x128 fp32 weight per step would add 6.25 MiB over steps 100-500; such leaks are caught
exactly by the per-step status checks anyway, the RSS bound is the coarse net.

``test_recipe_loop_allocates_nothing_per_step`` runs the main recipe's own functions
(``recipes/train_gpt.py``: ``build`` with ``BF16Optimizer`` and ``MixedPrecision``, ``train_step``,
``evaluate``, ``save`` through DCP) on a tiny GPT for 80 steps and compares steps 30 and 80 by
what is allocated, not by RSS: Python objects, bytes of live tensors plus the coordinator's storage
pool, and glibc's heap in use (``mallinfo2``). Measured: +5 objects (the samples themselves), 0
tensor bytes, 100-600 heap bytes per step. Keeping each step's result fails it (objects and tensor
bytes); so does torch's flight recorder (``TORCH_FR_BUFFER_SIZE=2000``: +13 KB of heap per step).
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys

import pytest
import torch
import torch.distributed as dist
from harness import run

from parts.observe import snapshot
from parts.partition import ParamStatus, attach, meta, partitioned, shards

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recipes"))
from gpt_model import GPT, GPTConfig  # noqa: E402

STEPS = 500
WARMUP = 100  # steps before the RSS baseline: allocator pools, the trace, AdamW state
RSS_GROWTH_BOUND = 6 << 20  # bytes; see the module docstring for what was measured
CONFIG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
BATCH = 4
PERSISTENCE = 100  # persistence_threshold: norms and biases stay gathered, weights do not


def _hook_count(model: torch.nn.Module) -> int:
    """Module hooks of every kind plus post-accumulate-grad hooks of every parameter."""
    n = 0
    for module in model.modules():
        for name in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
                     "_state_dict_pre_hooks", "_load_state_dict_pre_hooks"):
            n += len(getattr(module, name, {}))
    for p in model.parameters():
        n += len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
    return n


def _trim() -> None:
    """glibc ``malloc_trim(0)`` where available (no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 16 + rank)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _leaks(model: torch.nn.Module) -> list[str]:
    """Parameters gathered after a step that should not be (or holding a full grad)."""
    bad = []
    for name, p in model.named_parameters():
        m = meta(p)
        persistent = m.numel <= PERSISTENCE  # the documented rule (model_persistence_threshold unset)
        expect = ParamStatus.AVAILABLE if persistent else ParamStatus.NOT_AVAILABLE
        if m.status is not expect or p.data.numel() != (m.numel if persistent else 0) or p.grad is not None:
            bad.append(f"{name}: {m.status.value}, data {p.data.numel()}, grad {p.grad is not None}")
    return bad


def body_soak(steps: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    with partitioned():
        model = GPT(CONFIG)
    coordinator = attach(model, persistence_threshold=PERSISTENCE)
    persistent = sum(meta(p).numel <= PERSISTENCE for p in model.parameters())
    assert 0 < persistent < len(list(model.parameters()))
    optimizer = torch.optim.AdamW(shards(model), lr=1e-3)
    hooks = _hook_count(model)
    rss, losses, previous, changes = [], [], None, []
    for step in range(steps):
        x, y = _batch(step, rank)
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        leaks = _leaks(model)
        assert not leaks, f"step {step}: {leaks[:3]}"
        assert _hook_count(model) == hooks, f"step {step}: {_hook_count(model)} hooks, {hooks} at start"
        stats = coordinator.stats().as_dict()
        assert stats["persistent_params"] == persistent
        stats.pop("steps")
        if previous is not None and stats != previous:
            changes.append((step, {k: (previous[k], v) for k, v in stats.items() if previous[k] != v}))
        previous = stats
        losses.append(loss.item())
        if step % 10 == 0:
            gc.collect()
            _trim()  # hand freed heap pages back so RSS counts live memory, not fragmentation
            rss.append(snapshot().rss_bytes)
    return {"rss": rss, "losses": losses, "changes": changes, "hooks": hooks,
            "last_stats": previous}


@pytest.mark.slow
def test_soak_500_steps_no_leak() -> None:
    results = run(2, body_soak, STEPS, timeout=120)
    for rank, result in enumerate(results):
        rss = result["rss"]
        base = rss[WARMUP // 10]
        growth = max(rss[WARMUP // 10:]) - base
        print(f"rank {rank}: RSS at step 0 {rss[0] / 2**20:.1f} MiB, after warm-up {base / 2**20:.1f} "
              f"MiB, max after {max(rss[WARMUP // 10:]) / 2**20:.1f} MiB, final {rss[-1] / 2**20:.1f} MiB, "
              f"growth {growth / 2**20:.2f} MiB")
        assert growth < RSS_GROWTH_BOUND, f"rank {rank}: RSS grew {growth} bytes after warm-up"
        # the first steps record the trace and replay it; from then on every step is the same
        late = [(step, diff) for step, diff in result["changes"] if step > 2]
        assert not late, f"rank {rank}: stats changed: {late[:3]}"
        assert result["last_stats"]["trace_outcome"] == "replayed"
        assert result["hooks"] > 0
    # the model learned something (the loop was not a no-op)
    assert sum(results[0]["losses"][-20:]) < sum(results[0]["losses"][:20])


# The main recipe's own loop (recipes/train_gpt.py: build, train_step, evaluate, save), tiny.
RECIPE_FLAGS = ["--dtype", "bf16", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "16",
                "--batch-size", "4", "--eval-batches", "2", "--device", "cpu"]
RECIPE_STEPS, RECIPE_CYCLE, RECIPE_WARMUP = 80, 10, 30  # eval + checkpoint every cycle
HEAP_GROWTH_PER_STEP = 2048  # bytes of C heap in use; measured 300-500 after warm-up


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]


def _heap_in_use() -> int:
    """Bytes glibc's malloc has handed out and not had back (all arenas, mmapped blocks included)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages behind every tensor the garbage collector can see."""
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":
            storage = obj.untyped_storage()
            storages[storage.data_ptr(), storage.nbytes()] = storage.nbytes()
    return sum(storages.values())


def _memory_sample(coordinator) -> dict:
    gc.collect()
    return {"objects": len(gc.get_objects()), "heap": _heap_in_use(),
            "tensors": _live_tensor_bytes() + coordinator.stats().cached_bytes, "rss": snapshot().rss_bytes}


def body_recipe_loop(path: str, steps: int) -> list[tuple[int, dict]]:
    import train_gpt
    from chardata import VOCAB_SIZE, batch
    args = train_gpt.parse_args([*RECIPE_FLAGS, "--steps", str(steps)])
    model, coordinator, optimizer, schedule = train_gpt.build(args, torch.device("cpu"))
    tokens = torch.randint(VOCAB_SIZE, (4096,), generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(dist.get_rank())
    samples = []
    for step in range(1, steps + 1):
        train_gpt.train_step(model, optimizer, schedule, *batch(tokens, args.batch_size, args.seq_len, generator))
        if step % RECIPE_CYCLE == 0:
            train_gpt.evaluate(model, tokens, args)
            train_gpt.save(path, model, optimizer, schedule, step)
            samples.append((step, _memory_sample(coordinator)))
    assert optimizer.skipped_steps == 0
    return samples


@pytest.mark.slow
def test_recipe_loop_allocates_nothing_per_step(tmp_path) -> None:
    """BF16Optimizer, MixedPrecision, eval and a DCP save every 10 steps: after warm-up no Python
    object, no tensor byte and (almost) no C heap byte is kept per step, on either rank."""
    results = run(2, body_recipe_loop, str(tmp_path / "ckpt"), RECIPE_STEPS, timeout=120)
    for rank, samples in enumerate(results):
        base = dict(samples)[RECIPE_WARMUP]
        last = samples[-1][1]
        steps = RECIPE_STEPS - RECIPE_WARMUP
        print(f"rank {rank}: after step {RECIPE_WARMUP} -> {RECIPE_STEPS}: objects {base['objects']} -> "
              f"{last['objects']}, tensor bytes {base['tensors']} -> {last['tensors']}, heap in use "
              f"{(last['heap'] - base['heap']) / steps:+.0f} B/step, RSS {base['rss'] / 2**20:.1f} -> "
              f"{last['rss'] / 2**20:.1f} MiB")
        assert last["objects"] - base["objects"] < steps // 2, f"rank {rank}: Python objects kept per step"
        assert last["tensors"] <= base["tensors"], f"rank {rank}: tensor bytes kept per step"
        assert last["heap"] - base["heap"] < HEAP_GROWTH_PER_STEP * steps, f"rank {rank}: heap grows per step"
