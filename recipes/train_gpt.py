"""Train a character-level GPT with the parts of `parts`: the main recipe.

    torchrun --standalone --nproc-per-node 2 recipes/train_gpt.py
    torchrun --standalone --nproc-per-node 2 recipes/train_gpt.py --dtype fp32 --checkpoint --steps 300
    torchrun --standalone --nproc-per-node 3 recipes/train_gpt.py --resume --steps 200
    torchrun --standalone --nproc-per-node 8 recipes/train_gpt.py --device cuda   # one GPU per rank, NCCL

The compute dtype is bf16 where this hardware runs it faster than fp32 (measured at start,
said in the header), fp32 otherwise. The model is built in fp32 under ``partitioned()`` (each
rank keeps 1/N of every weight); in bf16, ``attach(mixed_precision=MixedPrecision())`` gathers
weights as bf16 (cast before the all-gather) and reduce-scatters grads in fp32 into fp32 grad
shards, so the fp32 shards are the masters and the loss tracks fp32. Weights below
``--persistence-threshold`` elements (100,000: the library's and DeepSpeed's default; at the
default size that is every weight of this 0.83M model) are refreshed once per step in one
all-gather and stay gathered; larger ones (all of them with ``--persistence-threshold 0``) are
fetched per block before use and released after it, which here costs 12-20% of the throughput.
With ``--checkpoint`` each block runs inside
``parts.checkpoint.checkpoint`` (off by default: recomputing costs this small model ~20% of
a step and saves little memory), and ``BF16Optimizer(AdamW, allow_fp32=True)`` steps the fp32
shards, clips by the global norm and
follows a warm-up + cosine schedule. With ``--no-partition`` the replicated fp32 model is cast
by ``BF16Optimizer(param_dtype=bf16)``, which keeps the full-precision values as its masters. The default data
is Python source text from the standard library (no download; characters, with four spaces as
one token: ``chardata``); ``--data FILE`` trains on yours; losses are in nats per character. At
the end every rank writes its own shard of the weights and optimizer state into a
``torch.distributed.checkpoint`` directory (``--out``; no rank gathers the model); ``--resume``
continues from it at any ``--nproc-per-node``, and FSDP2 (or ``dcp_to_torch_save``) reads it.
The sample is drawn on rank 0 from a plain ``GPT`` holding ``full_state_dict`` (temperature
and top-k sampling, ``--seed``). With ``--reproducible U`` each step's global batch is U units
of ``--batch-size`` sequences drawn from the step alone, each rank computes U/world of them one
by one (``backward_units``) and grads are summed in fixed point (``attach(reproducible=True)``):
the checkpoint in ``--out`` is the same bits at every ``--nproc-per-node`` that divides U,
``--resume`` included (docs/reproducibility.md).
"""

from __future__ import annotations

import argparse
import gc
import math
import os

import torch
import torch.distributed as dist

import devices
import report
import resilience
from chardata import VOCAB_SIZE, batch, char_count, decode, encode, load_splits
from gpt_model import GPT, GPTConfig
from parts.checkpoint import checkpoint
from parts.comm import all_gather_objects, broadcast_object
from parts.comm import dcp
from parts.observe import set_mmap_threshold, snapshot
from parts.optim import BF16Optimizer
from parts.partition import (MixedPrecision, attach, backward_units, full_state_dict, is_partitioned,
                             load_sharded_optimizer_state_dict, load_sharded_state_dict, meta,
                             partitioned, sharded_optimizer_state_dict, sharded_state_dict, unit_range)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Every knob is a flag; the defaults (1100 steps of 8 x 128 tokens per rank) train in
    about two and a quarter minutes on 2 CPU cores to a validation loss near 1.55 nats/char."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("--data", default=None, help="a text file to train on (default: stdlib sources)")
    add("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
        help="compute dtype (auto: bf16 where this hardware runs it faster than fp32)")
    add("--n-layer", type=int, default=4)
    add("--n-head", type=int, default=4)
    add("--n-embd", type=int, default=128)
    add("--seq-len", type=int, default=128)
    add("--batch-size", type=int, default=8, help="sequences per rank per step")
    add("--steps", type=int, default=1100, help="optimizer steps in this run")
    add("--lr", type=float, default=5e-3)
    add("--warmup", type=int, default=20)
    add("--lr-floor", type=float, default=0.1, help="the cosine decay ends at this fraction of --lr")
    add("--clip", type=float, default=1.0, help="global grad-norm clip (0: off)")
    add("--eval-interval", type=int, default=275)
    add("--eval-batches", type=int, default=12)
    add("--sample-chars", type=int, default=300)
    add("--prompt", default='class Reader:\n    """A reader."""\n\n    def __init__(self',
        help="text the sample continues")
    add("--temperature", type=float, default=0.8, help="sampling temperature of the sample")
    add("--top-k", type=int, default=5, help="sample from the k likeliest characters (0: all)")
    add("--seed", type=int, default=1234)
    add("--out", default="checkpoints/gpt", help="checkpoint directory (torch.distributed.checkpoint)")
    add("--resume", action="store_true", help="continue from --out (any world size)")
    add("--plot", default="loss.png", help="loss curve PNG (needs matplotlib)")
    add("--no-partition", dest="partition", action="store_false", help="replicated weights")
    add("--hybrid", action="store_true",
        help="shard within a node (LOCAL_WORLD_SIZE ranks), replicate across nodes (a 2-D mesh)")
    add("--checkpoint", action="store_true",
        help="recompute each block's activations in backward (parts.checkpoint): memory for compute; "
             "off by default, as this model's activations are small and recomputing costs ~20%% of a step")
    for knob, default in [("prefetch-bucket-size", 50_000_000), ("max-reuse-distance", 1_000_000_000),
                          ("max-live-parameters", 1_000_000_000), ("persistence-threshold", 100_000)]:
        add(f"--{knob}", type=int, default=default, help="coordinator knob")
    add("--no-overlap-comm", dest="overlap_comm", action="store_false", help="coordinator knob")
    add("--mmap-threshold", type=int, default=0,
        help="bytes: larger host allocations are mmapped, so freed shards leave RSS at once, at the "
             "cost of page faults (0: glibc's default, faster)")
    add("--memory-every", type=int, default=0,
        help="every N steps, note each rank's RSS and peak RSS (VmHWM) in MiB (0: off)")
    add("--reproducible", type=int, default=0, metavar="U",
        help="reproducible mode: each step's global batch is U units of --batch-size sequences, each "
             "rank computes U/world of them; the same weights at every --nproc-per-node dividing U (0: off)")
    resilience.add_flags(add)
    devices.add_device_flag(ap)
    return ap.parse_args(argv)


def choose_dtype(requested: str, device: torch.device) -> tuple[str, str]:
    """The dtype every rank trains in and why (rank 0 measures, so all ranks agree)."""
    if requested != "auto":
        return requested, "--dtype " + requested
    return broadcast_object(report.fastest_dtype(device) if dist.get_rank() == 0 else None, src=0)


def hybrid_mesh(args: argparse.Namespace, device: torch.device):
    """With --hybrid: a (replicate, shard) DeviceMesh, shards within each node of LOCAL_WORLD_SIZE
    ranks, one replica per node; else None (full sharding over every rank)."""
    if not args.hybrid:
        return None
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local:
        raise SystemExit(f"--hybrid: WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}")
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device.type, (world // local, local), mesh_dim_names=("replicate", "shard"))


def build(args: argparse.Namespace, device: torch.device | None = None):
    """Model (sharded and attached unless --no-partition), optimizer and LR schedule, on ``device``
    (default: ``--device``'s)."""
    device = devices.pick(args.device) if device is None else device
    config = GPTConfig(vocab_size=VOCAB_SIZE, block_size=args.seq_len, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    torch.manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    low = dtype if dtype != torch.float32 else None  # compute dtype below fp32, if any
    mesh = hybrid_mesh(args, device)
    with partitioned(mesh=mesh, device=device, enabled=args.partition):  # fp32 shards: the masters
        model = GPT(config, checkpoint_fn=checkpoint if args.checkpoint else None)
    if not args.partition:
        model.to(device)
    coordinator = attach(model, prefetch_bucket_size=args.prefetch_bucket_size,
                         max_reuse_distance=args.max_reuse_distance,
                         max_live_parameters=args.max_live_parameters,
                         persistence_threshold=args.persistence_threshold,
                         overlap_comm=args.overlap_comm,
                         mixed_precision=MixedPrecision(param_dtype=low) if low else None,
                         reproducible=bool(args.reproducible),
                         ) if args.partition else None
    adamw = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    optimizer = BF16Optimizer(adamw, group=mesh.get_group("shard") if mesh is not None else None,
                              clip_grad=args.clip, named_parameters=model.named_parameters(),
                              allow_fp32=True, param_dtype=None if args.partition else low)
    total = args.steps

    def warmup_cosine(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
        return args.lr_floor + (1 - args.lr_floor) * (1 + math.cos(math.pi * progress)) / 2
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
    return model, coordinator, optimizer, schedule


def nats_and_chars(loss: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[summed loss, characters]`` of a batch whose mean loss per token is ``loss``."""
    chars = char_count(targets.cpu()).double().to(loss.device)
    return torch.stack([loss.detach().double() * targets.numel(), chars])


def train_step(model, optimizer, schedule, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One optimizer step; returns ``[summed loss, characters]`` over every rank's batch."""
    loss = model(inputs, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    schedule.step()
    summed = nats_and_chars(loss, targets)
    dist.all_reduce(summed)
    return summed


def reproducible_step(model, optimizer, schedule, tokens: torch.Tensor, args: argparse.Namespace, step: int,
                      device: torch.device) -> torch.Tensor:
    """One optimizer step of ``--reproducible U``: the global batch of U units drawn from the step
    alone (the same at any world size), this rank's units one by one; ``[summed loss, characters]``
    over all units (every rank)."""
    generator = torch.Generator().manual_seed(args.seed + 7919 * step)
    rows = args.batch_size * args.reproducible
    inputs, targets = devices.to(device, *batch(tokens, rows, args.seq_len, generator))
    mean = backward_units(model, (inputs, targets), args.reproducible, lambda m, b: m(*b),
                          seed=args.seed * 100_003 + step)  # dropout masks per (step, unit)
    optimizer.step()
    optimizer.zero_grad()
    schedule.step()
    return torch.stack([mean * targets.numel(), char_count(targets.cpu()).double()])


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokens: torch.Tensor, args: argparse.Namespace,
             device: torch.device | None = None) -> float:
    """Loss per character over fixed validation batches (identical on every rank), computed on
    ``device`` (default: where the model's parameters compute)."""
    device = next(model.parameters()).device if device is None else device
    model.eval()
    generator = torch.Generator().manual_seed(0)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for _ in range(args.eval_batches):
        inputs, targets = devices.to(device, *batch(tokens, args.batch_size, args.seq_len, generator))
        total += nats_and_chars(model(inputs, targets), targets)
    model.train()
    return (total[0] / total[1]).item()


def checkpoint_state(model, optimizer, schedule, step: int) -> dict:
    """What a checkpoint holds: views of this rank's shards (weights, optimizer) and replicated values."""
    return {"model": sharded_state_dict(model), "optimizer": sharded_optimizer_state_dict(model, optimizer),
            "schedule": schedule.state_dict(), "step": step, "world_size": dist.get_world_size()}


def save(path: str, model, optimizer, schedule, step: int) -> None:
    """Every rank writes its shards; ``path`` (a DCP directory) is replaced only once the new
    checkpoint is complete and verified, and a failed save (a full disk) raises on every rank."""
    dcp.save(checkpoint_state(model, optimizer, schedule, step), checkpoint_id=path)


def resume(path: str, model, optimizer, schedule) -> int:
    """Load a checkpoint written at any world size; return the step it was taken at. A missing,
    damaged or mismatched checkpoint raises ``CheckpointError`` on every rank, naming it."""
    state = checkpoint_state(model, optimizer, schedule, 0)
    dcp.load(state, checkpoint_id=path)
    load_sharded_state_dict(model, state["model"])
    load_sharded_optimizer_state_dict(model, optimizer, state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    return state["step"]


def restore_snapshot(snaps, model, optimizer, schedule, generator: torch.Generator, args, end: int):
    """With ``--snapshot-every``: load the newest snapshot of this job (after a restart by
    torchrun's agent); (its step, the run's last step), or None where there is none."""
    state = {**checkpoint_state(model, optimizer, schedule, 0), "end": end}
    step = resilience.restore(snaps, state, generator)
    if step is None:
        return None
    load_sharded_state_dict(model, state["model"])
    load_sharded_optimizer_state_dict(model, optimizer, state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    if state["world_size"] != dist.get_world_size():  # another world: each rank's data anew
        generator.manual_seed(args.seed + 7919 * dist.get_rank() + step)
    return step, state["end"]


def rss_per_rank(device: torch.device, peak: bool = False) -> list[float]:
    """Every rank's current RSS (or peak RSS) in MiB (a small all-gather on the group's ``device``)."""
    now = snapshot()
    mine = torch.tensor([(now.peak_rss_bytes if peak else now.rss_bytes) / 2**20], dtype=torch.float64,
                        device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.item() for t in every]


def main() -> None:
    args = parse_args()
    # torch's flight recorder keeps a record (Python traceback, names, sizes) of each of the last
    # 2,000 collectives: at six per step each lives ~330 steps, then its replacement is carved out
    # of the free blocks between the step's activation buffers, which splits them, and the heap
    # (RSS) of a rank creeps up. Off unless set: nothing here is debugged from its records.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")
    resilience.note("started")
    device = devices.init(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    # reproducible mode: a CPU kernel's sums may depend on its thread count, so one per rank at any world
    torch.set_num_threads(1 if args.reproducible else max(1, (os.cpu_count() or 1) // world))
    if args.mmap_threshold:
        set_mmap_threshold(args.mmap_threshold)
    args.dtype, why = choose_dtype(args.dtype, device)
    if args.reproducible:
        if not args.partition:
            raise SystemExit("--reproducible needs sharded weights: drop --no-partition")
        try:
            unit_range(args.reproducible, rank, world)
        except ValueError as err:
            raise SystemExit(f"--reproducible {args.reproducible}: {err}") from None
    model, coordinator, optimizer, schedule = build(args, device)
    train_tokens, val_tokens = load_splits(args.data)
    start = resume(args.out, model, optimizer, schedule) if args.resume else 0
    generator = torch.Generator().manual_seed(args.seed + 7919 * rank + start)
    snaps, end = resilience.snapshots(args), start + args.steps
    start, end = restore_snapshot(snaps, model, optimizer, schedule, generator, args, end) or (start, end)
    params = sum(meta(p).numel if is_partitioned(p) else p.numel() for p in model.parameters())
    progress = report.Progress(end - start, enabled=rank == 0)
    progress.note(f"GPT {params / 1e6:.2f}M params, {args.dtype} ({why}), world {world}, "
                  f"{char_count(train_tokens).item():,} training chars in {len(train_tokens):,} tokens, "
                  f"steps {start + 1}..{end}")
    train_curve, val_curve = [], [(start, evaluate(model, val_tokens, args, device))]
    progress.note(f"step {start}: validation loss {val_curve[0][1]:.4f}")
    tokens_per_step = args.batch_size * args.seq_len * (args.reproducible or world)
    with resilience.heartbeat(args) as beat:
        resilience.tick()
        for step in range(start + 1, end + 1):
            if beat:
                beat.at_step(step)
            inputs, targets = devices.to(device, *batch(train_tokens, args.batch_size, args.seq_len, generator))
            summed = (reproducible_step(model, optimizer, schedule, train_tokens, args, step, device)
                      if args.reproducible else train_step(model, optimizer, schedule, inputs, targets))
            resilience.inject(step, rank)
            if snaps is not None and snaps.due(step):  # RNG states and the data generator go with it
                snaps.save({**checkpoint_state(model, optimizer, schedule, step), "end": end}, step,
                           local={"data": generator.get_state()})
            train_stats = coordinator.stats() if coordinator else None
            train_curve.append((step, (summed[0] / summed[1]).item()))  # nats per character
            done = step - start
            if done == 1:
                resilience.note("first step", step=step)
            rss = rss_per_rank(device) if done % 10 == 0 or step == end else None
            progress.update(done, loss=f"{train_curve[-1][1]:.4f}",
                            **{"tok/s": f"{tokens_per_step * done / progress.elapsed():,.0f}"},
                            **({"RSS MiB": "/".join(f"{r:.0f}" for r in rss)} if rss else {}))
            if args.memory_every and done % args.memory_every == 0:
                now, peaks = rss or rss_per_rank(device), rss_per_rank(device, peak=True)
                progress.note(f"step {step}: RSS MiB per rank {' '.join(f'{r:.1f}' for r in now)}"
                              f", peak {' '.join(f'{r:.1f}' for r in peaks)}")
            if done % args.eval_interval == 0 or step == end:
                val_curve.append((step, evaluate(model, val_tokens, args, device)))
                progress.note(f"step {step}: validation loss {val_curve[-1][1]:.4f}")
            resilience.tick()
    elapsed = progress.elapsed()
    resilience.note("trained", seconds=elapsed, steps=end - start, **resilience.step_times())
    sample = generate(model, args)
    save(args.out, model, optimizer, schedule, end)
    if snaps is not None:
        resilience.note("snapshots", saves=snaps.saves, seconds=snaps.save_seconds, thread_seconds=snaps.thread_seconds,
                        sent_bytes=snaps.sent_bytes, network=snaps.network)
        snaps.close()  # a clean finish: the job's snapshots leave host memory
    summarize(args, train_stats, optimizer, train_curve, val_curve, elapsed, sample, world)
    del model, coordinator, optimizer, schedule
    gc.collect()  # the coordinator's hooks and buffers go before the process group does
    dist.barrier()  # no rank tears its connections down while another is still using them
    dist.destroy_process_group()


def generate(model, args) -> str:
    """A sample on rank 0 ("" elsewhere) from a plain GPT holding the trained weights: one
    gather (``full_state_dict``) instead of fetching every module for every character."""
    state = full_state_dict(model) if args.partition else model.state_dict()
    if dist.get_rank() != 0:
        return ""
    plain = GPT(model.config).eval()
    plain.load_state_dict(state)
    torch.manual_seed(args.seed)
    prompt = encode(args.prompt).unsqueeze(0)
    tokens = plain.generate(prompt, args.sample_chars, temperature=args.temperature, top_k=args.top_k or None)
    return decode(tokens[0])


def summarize(args, stats, optimizer, train_curve, val_curve, elapsed, sample, world) -> None:
    """Sample, summary table and loss curve on rank 0."""
    every = all_gather_objects(snapshot().peak_rss_bytes)
    if dist.get_rank() != 0:
        return
    steps = len(train_curve)
    rows = [("steps", f"{steps} ({train_curve[0][0]}..{train_curve[-1][0]})"),
            ("time", f"{elapsed:.1f} s ({elapsed / steps:.2f} s/step)"),
            ("tokens/s", f"{steps * args.batch_size * args.seq_len * (args.reproducible or world) / elapsed:,.0f}"),
            ("train loss", f"{train_curve[0][1]:.4f} -> {train_curve[-1][1]:.4f}"),
            ("validation loss", f"{val_curve[0][1]:.4f} -> {val_curve[-1][1]:.4f}"),
            ("peak RSS per rank", ", ".join(report.mib(b) for b in every)),
            ("skipped steps (non-finite grads)", str(optimizer.skipped_steps))]
    if stats:
        rows += [("all-gathered per step", report.mib(stats.allgather_bytes)),
                 ("reduce-scattered per step", report.mib(stats.reduce_scatter_bytes)),
                 ("persistent params refreshed per step", str(stats.persistent_gathers)),
                 ("prefetch hits / fetches", f"{stats.prefetch_hits} / {stats.fetches}")]
    print(f"\n--- sample ---\n{sample}\n--------------\n{report.table(rows)}")
    plot = report.plot_losses(args.plot, train_curve, val_curve)
    print(f"checkpoint: {args.out}" + (f"   loss curve: {plot}" if plot else ""))


if __name__ == "__main__":
    main()
