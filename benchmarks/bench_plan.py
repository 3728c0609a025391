"""The planner at scale and against reality: Llama 7B and 70B shapes at 8, 64 and 1024 ranks.

    python benchmarks/bench_plan.py              # estimate + dry run of every row, CLI time, real runs
    python benchmarks/bench_plan.py --quick      # 7B rows only, no real runs

For each model and world size: the estimate (``parts.plan.estimate``, arithmetic on the
shapes) and the dry run (``parts.plan.dry_run``: the real coordinator on a fake world, the
model on the meta device), each in a fresh process (its own time and peak RSS), whether they
agree byte for byte, and per-rank model states beside the ZeRO formula and DeepSpeed's
estimate. Then ``python -m parts.plan`` on the 70B config at world 1024, timed as a user
runs it. Then real gloo runs at world 2 and 4 of a 25M GPT-like model: the counters against
the plan, and peak RSS growth against the plan's peak bytes (the plan has no activations,
allocator caches or communication buffers: the margin is what those cost).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import record

LLAMA = {"7B": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=32),
         "70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                     num_key_value_heads=8)}
GPT_25M = dict(vocab_size=128, block_size=128, n_layer=8, n_embd=512, n_head=8)  # bench_zero3's model
BYTES = ("param_bytes", "grad_bytes", "optimizer_bytes", "persistent_bytes", "gathered_peak_bytes",
         "allgather_bytes", "reduce_scatter_bytes")
GIB = 1 << 30


def config_file(name: str, directory: Path) -> Path:
    """A Llama-shaped Hugging Face config (vocab 32000, untied) for ``name``."""
    path = directory / f"llama{name.lower()}.json"
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 32000, "tie_word_embeddings": False,
                                "max_position_embeddings": 4096, **LLAMA[name]}))
    return path


def child(mode: str, config: str, world: int, shard_size: int) -> None:
    """In a fresh process: plan ``config`` at ``world`` (estimate or dry run); print JSON."""
    from parts.plan import dry_run, estimate, shape_of
    from parts.plan.models import hf_builder, on_meta

    build = hf_builder(config)
    start = time.perf_counter()
    shard_size = shard_size or None
    if mode == "estimate":
        plan = estimate(shape_of(on_meta(build)), world, shard_size=shard_size)
    else:
        plan = dry_run(build, world, step=_tokens, shard_size=shard_size)
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "rss_MiB": rss, **plan.as_dict()}))


def _tokens(model, device):
    import torch

    ids = torch.randint(0, 32000, (1, 16), device=device)
    return model(input_ids=ids, labels=ids).loss


def spawn(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def plan_row(name: str, config: Path, world: int, shard_size: int = 0) -> dict:
    """One model at one world size (a hybrid layout with ``shard_size``): estimate and dry run side by side."""
    args = (str(config), str(world), str(shard_size))
    est, dry = spawn("estimate", *args), spawn("dry_run", *args)
    params = est["params"]
    largest = LLAMA[name]["hidden_size"] * 32000
    layout = f"hybrid {world // shard_size} x {shard_size}" if shard_size else "full"
    return {"model": f"Llama {name}", "world": world, "layout": layout, "params_B": round(params / 1e9, 3),
            "model_states_GiB": round(est["model_state_bytes"] / GIB, 3),
            "16Psi/N_GiB": round(16 * params / (shard_size or world) / GIB, 3),  # N: ranks sharing a shard
            "peak_GiB": round(est["peak_bytes"] / GIB, 3),
            "deepspeed_estimate_GiB": round((int(18 * params / (shard_size or world)) + 4 * largest) / GIB, 3),
            "traffic_per_step_GB": round(est["step_bytes"] / 1e9, 2),
            "all_reduce_GB": round(est["all_reduce_bytes"] / 1e9, 2),
            "3Psi(N-1)/N_GB": round(3 * 4 * params * ((shard_size or world) - 1) / (shard_size or world) / 1e9, 2),
            "estimate_s": round(est["seconds"], 2), "dry_run_s": round(dry["seconds"], 1),
            "dry_run_rss_MiB": round(dry["rss_MiB"]),
            "estimate_equals_dry_run": all(est[k] == dry[k] for k in BYTES)}


def cli_seconds(config: Path) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "parts.plan", "--config", str(config), "--world-size", "1024",
                    "--ranks-per-node", "8"], check=True, capture_output=True)
    return time.perf_counter() - start


def real_rank(rank: int, world: int, port: int, queue) -> None:
    """One rank of a real gloo run: the counters and peak RSS growth against the dry run's plan."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
    from gpt_model import GPT, GPTConfig

    from parts.partition import attach, partitioned
    from parts.plan import measure

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.manual_seed(0)
    with partitioned():
        model = GPT(GPTConfig(**GPT_25M))
    coordinator = attach(model)
    plan = measure(model, coordinator, step=_gpt_step, device=torch.device("cpu"), steps=3)
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    queue.put((rank, plan.as_dict(), growth))
    dist.destroy_process_group()


def _gpt_step(model, device):
    import torch

    x = torch.randint(0, model.config.vocab_size, (4, model.config.block_size), device=device)
    return model(x, x)


def real_row(world: int) -> dict:
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
    from gpt_model import GPT, GPTConfig

    from parts.plan import dry_run

    queue = mp.get_context("spawn").Queue()
    port = 29500 + os.getpid() % 1000
    procs = [mp.get_context("spawn").Process(target=real_rank, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(queue.get() for _ in procs)
    for p in procs:
        p.join()
    plan = dry_run(lambda: GPT(GPTConfig(**GPT_25M)), world, step=_gpt_step, steps=3).as_dict()
    growth = max(g for _, _, g in results)
    return {"model": "GPT 25M (recipes/gpt_model.py)", "world": world,
            "counters_equal_dry_run": all(all(r[k] == plan[k] for k in BYTES) for _, r, _ in results),
            "plan_peak_MiB": round(plan["peak_bytes"] / 2**20), "measured_rss_growth_MiB": round(growth / 2**20),
            "growth_over_plan": round(growth / plan["peak_bytes"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="7B rows only, no real runs")
    parser.add_argument("--child", nargs=4, metavar=("MODE", "CONFIG", "WORLD", "SHARD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], int(args.child[2]), int(args.child[3]))
    with tempfile.TemporaryDirectory() as tmp:
        configs = {name: config_file(name, Path(tmp)) for name in LLAMA}
        names = ["7B"] if args.quick else ["7B", "70B"]
        rows = [plan_row(name, configs[name], world) for name in names for world in (8, 64, 1024)]
        rows += [plan_row(name, configs[name], 1024, 8) for name in names]
        for row in rows:
            print(row, flush=True)
        summary = {}
        if not args.quick:
            summary["python -m parts.plan, Llama 70B at world 1024 (s, wall)"] = round(cli_seconds(configs["70B"]), 1)
            real = [real_row(world) for world in (2, 4)]
            for row in real:
                print(row, flush=True)
            rows += real
    record("bench_plan", {"rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
