"""Soak of parts.offload: a small GPT with shards and AdamW state on disk, trained for many steps
and then sampled many times; RSS and live Python objects must stay flat.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_offload_soak.py
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_offload_soak.py --steps 200 --generates 200
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_offload_soak.py --device cuda  # GPU compute, NCCL

Phase 1: ``--steps`` training steps under ``partitioned(remote_device=DiskStore)`` +
``attach`` + ``OffloadedOptimizer(AdamW)``, every step inside ``step_in_backward`` (the
optimizer steps each parameter as its grad lands) unless ``--after-backward``. Phase 2:
``--generates`` calls of ``GPT.generate`` (``--new-tokens`` forwards each) on the same model.
Every ``--every`` steps (calls) each rank samples its RSS (after ``gc.collect`` and glibc's
``malloc_trim``, so freed heap pages are not counted), the number of live Python objects
(``gc.get_objects``) and of live store operations (``parts.offload._ioqueue.Op``). Growth is
measured from the first sample after ``--warmup`` steps (calls) to the last: flat means
growth within the noise of the allocator (a few MiB), objects within a few hundred, store
operations not growing at all. The result goes to ``results/bench_offload_soak.jsonl``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import devices  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402
from record import record  # noqa: E402

from parts.comm import all_gather_objects  # noqa: E402
from parts.observe import snapshot  # noqa: E402
from parts.offload import DiskStore, OffloadedOptimizer  # noqa: E402
from parts.offload._ioqueue import Op  # noqa: E402
from parts.partition import attach, detach, partitioned, shards  # noqa: E402

MiB = 2**20
_DEVICE = [torch.device("cpu")]  # this rank's compute device, set from --device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags (every default shown by ``--help``); ``args.device`` comes back resolved to ``cpu`` or ``cuda``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = ap.add_argument
    add("--steps", type=int, default=1000, help="training steps (phase 1)")
    add("--generates", type=int, default=1000, help="generate() calls (phase 2)")
    add("--new-tokens", type=int, default=2, help="tokens each generate() call samples")
    add("--every", type=int, default=100, help="steps (calls) between samples")
    add("--warmup", type=int, default=100, help="steps (calls) before the growth baseline")
    add("--layers", type=int, default=2, help="GPT blocks")
    add("--width", type=int, default=64, help="GPT embedding width")
    add("--seq-len", type=int, default=32, help="tokens per sequence")
    add("--batch-size", type=int, default=4, help="sequences per rank per step")
    add("--after-backward", action="store_true", help="step after backward, not during it")
    add("--store", default=tempfile.gettempdir(), help="parent directory of the per-rank stores")
    add("--no-record", action="store_true", help="print only (a trial run): nothing appended to results/")
    return devices.parse_with_device(ap, argv)


def sample() -> dict[str, float]:
    """This rank's RSS (MiB), live objects and live store operations, after a collection."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    objects = gc.get_objects()
    ops = sum(1 for o in objects if type(o) is Op)
    return {"rss_mib": snapshot().rss_bytes / MiB, "objects": len(objects), "ops": ops}


def growth(samples: list[tuple[int, dict]], warmup: int) -> dict[str, float]:
    """Last sample minus the first at or after ``warmup``, per field."""
    base = next(s for i, s in samples if i >= warmup)
    last = samples[-1][1]
    return {k: round(last[k] - base[k], 2) for k in base}


def train(model, optimizer, config: GPTConfig, args: argparse.Namespace, rank: int) -> list:
    """Phase 1; the samples taken."""
    samples, gen = [], torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        tokens = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)
        loss = model(*devices.to(_DEVICE[0], tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        if args.after_backward:
            loss.backward()
        else:
            with optimizer.step_in_backward():
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % args.every == 0 or step == 0:
            samples.append((step + 1, sample()))
    return samples


def generate(model, config: GPTConfig, args: argparse.Namespace) -> list:
    """Phase 2; the samples taken."""
    samples, gen = [], torch.Generator().manual_seed(0)  # same prompts on every rank
    model.eval()
    for call in range(args.generates):
        prompt, = devices.to(_DEVICE[0], torch.randint(0, config.vocab_size, (1, 8), generator=gen))
        model.generate(prompt, args.new_tokens)
        if (call + 1) % args.every == 0 or call == 0:
            samples.append((call + 1, sample()))
    return samples


def main() -> None:
    args = parse_args()
    _DEVICE[0] = devices.init(args.device)  # gloo, or NCCL on LOCAL_RANK's GPU
    rank = dist.get_rank()
    torch.set_num_threads(1)
    config = GPTConfig(vocab_size=64, block_size=args.seq_len, n_layer=args.layers, n_head=2, n_embd=args.width)
    store = DiskStore(os.path.join(args.store, f"parts-soak-rank{rank}"))
    torch.manual_seed(0)
    with partitioned(device=_DEVICE[0], remote_device=store):
        model = GPT(config)
    attach(model)
    optimizer = OffloadedOptimizer(torch.optim.AdamW(shards(model), lr=1e-3), store)
    start = time.perf_counter()
    trained = train(model, optimizer, config, args, rank)
    train_seconds = time.perf_counter() - start
    generated = generate(model, config, args)
    seconds = time.perf_counter() - start
    results = all_gather_objects({"train": trained, "generate": generated})
    optimizer.settle()
    detach(model)
    store.close()
    if rank == 0:
        report(results, args, train_seconds, seconds)
    dist.destroy_process_group()


def report(results: list[dict], args: argparse.Namespace, train_seconds: float, seconds: float) -> None:
    """Print the samples and the growth per rank; record the run."""
    row: dict = {"steps": args.steps, "generates": args.generates, "new_tokens": args.new_tokens,
                 "layers": args.layers, "width": args.width, "world": len(results),
                 "in_backward": not args.after_backward, "train_s": round(train_seconds, 1),
                 "total_s": round(seconds, 1), "device": args.device}
    for rank, phases in enumerate(results):
        for phase, samples in phases.items():
            for i, s in samples:
                print(f"rank {rank} {phase:8s} {i:5d}: RSS {s['rss_mib']:7.1f} MiB, "
                      f"{s['objects']:7d} objects, {s['ops']:4d} store ops", flush=True)
            g = growth(samples, args.warmup)
            print(f"rank {rank} {phase}: growth after {args.warmup}: RSS {g['rss_mib']:+.2f} MiB, "
                  f"objects {g['objects']:+.0f}, store ops {g['ops']:+.0f}", flush=True)
            first = next(s for i, s in samples if i >= args.warmup)
            row.update({f"r{rank}_{phase}_rss_mib": round(first["rss_mib"], 1),
                        f"r{rank}_{phase}_rss_growth_mib": g["rss_mib"],
                        f"r{rank}_{phase}_objects_growth": g["objects"],
                        f"r{rank}_{phase}_ops_growth": g["ops"]})
    name = "bench_offload_soak" + ("_cuda" if args.device == "cuda" else "")
    where = "not recorded" if args.no_record else f"recorded in {record(name, row)}"
    print(f"wall: training {train_seconds:.0f} s, total {seconds:.0f} s; {where}", flush=True)


if __name__ == "__main__":
    main()
