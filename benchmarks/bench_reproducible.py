"""What reproducible mode costs: step time and wire bytes against the default mode, side by side.

    python benchmarks/bench_reproducible.py                     # the recipe's GPT, world 2, 30 steps
    python benchmarks/bench_reproducible.py --model 25m --steps 10   # bench_zero3's 25M GPT
                                                                     # (recorded as bench_reproducible_25m)

One run of two ranks (gloo, one intra-op thread each) trains the GPT of recipes/gpt_model.py,
fp32, AdamW with ``clip_grad_norm_(model, 1.0)``, on batches of Python text
(recipes/chardata.py), in four settings built side by side in the same processes, one step of
each in turn (so load drift on a shared machine hits all alike):

* ``default, 1 unit per rank``: ``attach(model)``; each rank one micro-batch of ``--batch``
  sequences, grads averaged over ranks (fp32 reduce-scatter).
* ``reproducible, U = world``: ``attach(model, reproducible=True)`` and ``backward_units`` over
  the same global batch cut into 2 units: each rank computes the same sequences as above, its
  grads exchanged as floats (an all-to-all) and summed in int64 fixed point on their receiver,
  the clip norm in fixed point.
* ``default, K micro-batches per rank`` and ``reproducible, U = K * world``: the same with
  ``--accumulate`` K micro-batches of ``--batch`` sequences per rank (gradient accumulation;
  reproducible mode computes its units one by one the same way).

Per row: the median step (forward, backward, the mean loss over ranks, clip, optimizer step) in
wall time and in rank 0's CPU time (steadier where other jobs share the cores), rank 0's bytes
per step on the wire by kind (``parts.comm.comm_counter``: reduce-scatter, all-to-all,
all-gather, all-reduce, and small agreements counted as ``check``), and each against its default
row; ``grad_bytes_vs_default`` compares the grad reduction's bytes (the reduce-scatter, or
reproducible mode's all-to-all) with the default row's. The
measured steps are cut into ``--rounds`` consecutive rounds: a ratio is the median over the
rounds of each round's median against its default row's in the same round, and its range over
the rounds is shown beside it.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
from gpt_model import GPT, GPTConfig  # noqa: E402
from record import record  # noqa: E402

MODELS = {"recipe": dict(n_layer=4, n_embd=128, n_head=4, seq=128),  # recipes/train_gpt.py's default GPT
          "25m": dict(n_layer=8, n_embd=512, n_head=8, seq=128)}  # bench_zero3's 25.4M GPT
KINDS = ("reduce_scatter_bytes", "all_to_all_bytes", "allgather_bytes", "all_reduce_bytes", "check_bytes")
GRAD_KINDS = ("reduce_scatter_bytes", "all_to_all_bytes")  # the grad reduction: either one
WORLD = 2


def _settings(accumulate: int) -> list[tuple[str, bool, int]]:
    """``(name, reproducible, micro-batches per rank)`` of each setting."""
    return [("default, 1 unit per rank", False, 1), (f"reproducible, U = {WORLD}", True, 1),
            (f"default, {accumulate} micro-batches per rank", False, accumulate),
            (f"reproducible, U = {accumulate * WORLD}", True, accumulate)]


def _build(config: GPTConfig, reproducible: bool) -> tuple:
    from parts.partition import attach, partitioned, shards
    torch.manual_seed(0)
    with partitioned():
        model = GPT(config)
    attach(model, reproducible=reproducible)
    return model, torch.optim.AdamW(shards(model), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def _step(model, optimizer, reproducible: bool, per_rank: int, inputs: torch.Tensor,
          targets: torch.Tensor) -> tuple[float, float]:
    """One training step over the global batch (``inputs``: every rank's rows); returns its wall and
    CPU seconds (this process, its communication threads included)."""
    from parts.partition import backward_units, clip_grad_norm_
    rank = dist.get_rank()
    started, cpu = time.perf_counter(), time.process_time()
    if reproducible:
        backward_units(model, (inputs, targets), per_rank * WORLD, lambda m, b: m(*b))
    else:  # each rank's micro-batches: the same rows as its units above; the mean loss, as backward_units
        rows, total = inputs.shape[0] // (per_rank * WORLD), torch.zeros((), dtype=torch.float64)
        for k in range(per_rank):
            mine = slice((rank * per_rank + k) * rows, (rank * per_rank + k + 1) * rows)
            loss = model(inputs[mine], targets[mine])
            (loss / per_rank).backward()
            total += loss.detach()
        dist.all_reduce(total)
    clip_grad_norm_(model, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started, time.process_time() - cpu


def _worker(rank: int, port: int, args: argparse.Namespace, out: dict) -> None:
    from chardata import batch as make_batch, load_splits
    from parts.comm import comm_counter
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    shape = MODELS[args.model]
    config = GPTConfig(block_size=shape["seq"], n_layer=shape["n_layer"], n_head=shape["n_head"],
                       n_embd=shape["n_embd"])
    settings = _settings(args.accumulate)
    built = [_build(config, reproducible) for _, reproducible, _ in settings]
    tokens, generator = load_splits(None)[0], torch.Generator().manual_seed(7)
    times: list[list[float]] = [[] for _ in settings]
    cpus: list[list[float]] = [[] for _ in settings]
    moved = [dict.fromkeys(KINDS, 0) for _ in settings]
    for step in range(args.steps + args.warmup):
        for i, ((_, reproducible, per_rank), (model, optimizer)) in enumerate(zip(settings, built)):
            inputs, targets = make_batch(tokens, args.batch * per_rank * WORLD, config.block_size, generator)
            before = comm_counter.snapshot()
            elapsed, cpu = _step(model, optimizer, reproducible, per_rank, inputs, targets)
            if step >= args.warmup:
                times[i].append(elapsed)
                cpus[i].append(cpu)
                after = comm_counter.snapshot()
                for kind in KINDS:
                    moved[i][kind] += after[kind] - before[kind]
    if rank == 0:
        for i, (name, _, _) in enumerate(settings):
            out[name] = dict(step=_by_round(times[i], args.rounds), cpu=_by_round(cpus[i], args.rounds),
                             bytes={k: v // args.steps for k, v in moved[i].items()})
    dist.destroy_process_group()


def _by_round(values: list[float], rounds: int) -> list[float]:
    """The median of each of ``rounds`` consecutive runs of ``values``."""
    size = max(1, len(values) // rounds)
    return [statistics.median(values[k * size:(k + 1) * size]) for k in range(min(rounds, len(values)))]


def _ratio(mine: list[float], base: list[float]) -> tuple[float, str]:
    """The median over rounds of ``mine / base`` and its range."""
    ratios = [a / b for a, b in zip(mine, base)]
    return round(statistics.median(ratios), 3), f"{min(ratios):.3f}-{max(ratios):.3f}"


def _rows(results: dict, settings: list) -> list[dict]:
    rows = []
    for i, (name, reproducible, per_rank) in enumerate(settings):
        r, base = results[name], results[settings[i - 1 if reproducible else i][0]]
        (step, step_range), (cpu, cpu_range) = _ratio(r["step"], base["step"]), _ratio(r["cpu"], base["cpu"])
        row = dict(setting=name, units_per_rank=per_rank, step_s=round(statistics.median(r["step"]), 4),
                   step_vs_default=step, step_range=step_range, cpu_s=round(statistics.median(r["cpu"]), 4),
                   cpu_vs_default=cpu, cpu_range=cpu_range)
        for kind in KINDS:
            row[f"{kind.split('_bytes')[0]}_MiB"] = round(r["bytes"][kind] / 2 ** 20, 3)
        grad, base_grad = (sum(b["bytes"][k] for k in GRAD_KINDS) for b in (r, base))
        total = sum(r["bytes"].values())
        row["grad_bytes_vs_default"] = round(grad / base_grad, 4)
        row["wire_vs_default"] = round(total / sum(base["bytes"].values()), 3)
        rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="recipe")
    parser.add_argument("--steps", type=int, default=30, help="measured steps of each setting")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5, help="rounds the measured steps are cut into")
    parser.add_argument("--batch", type=int, default=8, help="sequences per unit (micro-batch)")
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per rank of the U > world rows")
    parser.add_argument("--note", default="", help="recorded beside the table (how the machine was used)")
    parser.add_argument("--no-record", action="store_true")
    return parser.parse_args(argv)


def main() -> None:
    """Run every setting in one 2-rank job, print and record the table."""
    args = parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = mp.Manager().dict()
    started = time.perf_counter()
    mp.spawn(_worker, args=(port, args, out), nprocs=WORLD, join=True)
    rows = _rows(dict(out), _settings(args.accumulate))
    for row in rows:
        print(row)
    summary = {"model": f"{args.model} GPT ({MODELS[args.model]})", "world": WORLD, "steps": args.steps,
               "rounds": args.rounds,
               "sequences per unit": args.batch, "wall_s": round(time.perf_counter() - started)}
    if args.note:
        summary["note"] = args.note
    if not args.no_record:
        record("bench_reproducible" + ("" if args.model == "recipe" else f"_{args.model}"),
               {"rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
