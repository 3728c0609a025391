"""Generation under ZeRO-3 and the streaming export: tokens/s with and without ``generating``.

Also the peak RSS of ``parts.export``.

    python benchmarks/bench_generate.py                  # GPT-2 n_embd 256, 4 layers, world 2, 24 tokens
    python benchmarks/bench_generate.py --tokens 48 --rounds 5
    python benchmarks/bench_generate.py --device cuda     # generation on two GPUs, NCCL; records bench_generate_cuda

Generation: every rank of a world-2 gloo group generates ``--tokens`` greedy tokens from its
own prompt with (a) the unsharded HF GPT-2 (each rank a full copy: the reference), (b) the
sharded attached model without the context (``synced_gpus=True``: every decoding step gathers
every layer), (c) inside ``generating(model)`` (gathered once; the time includes the gather on
entry and the release on exit; ``gathered_entry_s`` is that gather alone) and (d) inside
``generating(model, memory_budget=0.9 x the model)``
(layers streamed). Best wall time of ``--rounds`` rounds on rank 0 (the modes take turns in
each round; the best round is the least disturbed by other jobs on a shared machine); every
mode's tokens must equal the unsharded model's.

Export: a world-2 parts checkpoint of ``--export-mib`` MiB (Linear layers of 1 MiB each, so
stored pieces of 0.5 MiB) is exported in a fresh process; its peak RSS growth over the RSS
before the export is compared with the bound (``--export-bound-mib``). The export reads and
writes files on the host, so it runs on the CPU with ``--device cuda`` too.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import devices  # noqa: E402
from record import record  # noqa: E402

MODES = ("unsharded", "sharded", "gathered", "streamed")
_DEVICE = [torch.device("cpu")]  # this rank's generation device, set from --device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _models(args: argparse.Namespace) -> tuple:
    import transformers
    from parts.partition import attach, full_state_dict, partitioned
    config = transformers.GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4)
    torch.manual_seed(0)
    with partitioned(device=_DEVICE[0]):
        model = transformers.GPT2LMHeadModel(config)
    attach(model)
    plain = transformers.GPT2LMHeadModel(config).to(_DEVICE[0])
    plain.load_state_dict(full_state_dict(model, rank0_only=False))
    return model.eval(), plain.eval()


def _timed(runs: dict, rounds: int) -> dict:
    """Best (least) seconds over the rounds and last tokens of each run; the modes take turns in
    every round, so a shared machine's load drift hits all of them alike, and the best round is
    the one least slowed by other jobs (what ``timeit`` reports)."""
    times: dict = {mode: [] for mode in runs}
    tokens: dict = {}
    names = list(runs)
    for r in range(rounds):
        for mode in names[r % len(names):] + names[:r % len(names)]:
            run = runs[mode]
            dist.barrier()
            devices.sync(_DEVICE[0])
            start = time.perf_counter()
            tokens[mode] = run()
            devices.sync(_DEVICE[0])
            times[mode].append(time.perf_counter() - start)
    return {mode: dict(seconds=min(times[mode]), tokens=tokens[mode]) for mode in runs}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    torch.set_num_threads(1)
    _DEVICE[0] = devices.init_spawned(args.device, rank, world, port)  # gloo, or NCCL on GPU ``rank``
    from parts.partition import generating
    model, plain = _models(args)
    prompt, = devices.to(_DEVICE[0], torch.randint(0, 50000, (1, 8), generator=torch.Generator().manual_seed(rank)))
    kw = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    below = sum(p.numel() * 4 for p in plain.parameters()) * 9 // 10  # the embedding is most of it

    entries: dict = {}

    def inside(budget):
        def go():
            start = time.perf_counter()
            with generating(model, memory_budget=budget) as mode:
                entries.setdefault(mode, []).append(time.perf_counter() - start)
                return model.generate(prompt, **kw)
        return go

    # the order rotates with the round: over 4 rounds each mode follows each other once (a run
    # right after the collective-heavy per-step gathers is measurably slower on a shared machine)
    runs = {"unsharded": lambda: plain.generate(prompt, **kw),
            "gathered": inside(None), "streamed": inside(below),
            "sharded": lambda: model.generate(prompt, synced_gpus=True, **kw)}
    for mode in MODES:
        runs[mode]()  # warm-up (and the coordinator's trace)
    results = _timed(runs, args.rounds)
    if rank == 0:
        out.update({m: r["seconds"] for m, r in results.items()})
        out.update({f"{m}_entry": min(t[1:]) for m, t in entries.items()})  # after warm-up
        out["same_tokens"] = all(torch.equal(r["tokens"], results["unsharded"]["tokens"]) for r in results.values())
        out["tokens"] = results["gathered"]["tokens"][0].tolist()
    dist.destroy_process_group()


def _save_big(rank: int, world: int, port: int, path: str, mib: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from parts.comm import dcp
    from parts.partition import partitioned, sharded_state_dict
    with partitioned():
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 256, bias=False) for _ in range(mib)])
    dcp.save(sharded_state_dict(model), checkpoint_id=path)
    dist.destroy_process_group()


_EXPORT_JOB = """
import json, resource, sys, time
from parts.export import export
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
start = time.perf_counter()
result = export(sys.argv[1], sys.argv[2], max_shard_size="64MB")
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(dict(base=base, peak=peak, seconds=seconds, total=result.total_bytes, files=len(result.files))))
"""


def _export(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        ckpt, out = os.path.join(scratch, "ckpt"), os.path.join(scratch, "hf")
        mp.spawn(_save_big, args=(2, _free_port(), ckpt, args.export_mib), nprocs=2)
        job = subprocess.run([sys.executable, "-c", _EXPORT_JOB, ckpt, out], capture_output=True, text=True,
                             check=True)
        return json.loads(job.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``args.device`` comes back resolved to ``cpu`` or ``cuda``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--export-mib", type=int, default=256)
    parser.add_argument("--export-bound-mib", type=int, default=32)
    return devices.parse_with_device(parser, argv)


def main() -> None:
    """Run both measurements, print them and record them."""
    args = parse_args()
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(2, _free_port(), args, out), nprocs=2)
    gen = dict(out)
    rows = [dict(mode=m, tokens_per_s=round(args.tokens / gen[m], 1), vs_unsharded=round(gen["unsharded"] / gen[m], 2))
            for m in MODES]
    summary = _summary(args, gen, _export(args))
    for row in rows:
        print(f"{row['mode']:10s} {row['tokens_per_s']:8.1f} tokens/s  {row['vs_unsharded']:.2f}x the unsharded model")
    for key, value in summary.items():
        print(f"{key:40s} {value}")
    print("tokens (rank 0):", gen["tokens"])
    record("bench_generate" + ("_cuda" if args.device == "cuda" else ""), dict(rows=rows, summary=summary))


def _summary(args: argparse.Namespace, gen: dict, exp: dict) -> dict:
    """The entry gather, generation alone, the tokens check and the export's memory against its bound."""
    growth = exp["peak"] - exp["base"]
    return {"gathered: entry gather s": round(gen["gathered_entry"], 3),
            "gathered: generate alone vs unsharded":
                round(gen["unsharded"] / (gen["gathered"] - gen["gathered_entry"]), 2),
            "every mode's tokens equal the unsharded model's": gen["same_tokens"],
            "export: model MiB": exp["total"] / 2**20, "export: bound MiB": args.export_bound_mib,
            "export: peak RSS growth MiB": round(growth / 2**20, 1),
            "export: peak RSS MiB": round(exp["peak"] / 2**20, 1),
            "export: within bound": growth <= args.export_bound_mib * 2**20,
            "export: MiB/s": round(exp["total"] / 2**20 / exp["seconds"], 1)}


if __name__ == "__main__":
    main()
