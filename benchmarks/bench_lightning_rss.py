"""Peak RSS per rank of Lightning's Trainer: ``strategy="parts"`` against Lightning's FSDP strategies.

    python benchmarks/bench_lightning_rss.py                      # world 2, CPU: parts vs FSDP2
    python benchmarks/bench_lightning_rss.py --device cuda        # one GPU per rank: FSDPStrategy too

Each system trains the same GPT (recipes/gpt_model.py, about 43 M parameters by default),
built in ``LightningModule.configure_model`` as Lightning's docs have it for sharded
strategies, with AdamW, for ``--steps`` steps, in fresh processes (``torchrun``, one launch
per system and round, so that each peak is the system's own):

- ``parts``: ``Trainer(strategy="parts")``: each module sharded as it is built;
- ``fsdp2``: ``ModelParallelStrategy`` with ``fully_shard`` on each block and the model in
  ``configure_model`` (Lightning's FSDP2 path; it runs on the CPU);
- ``fsdp``: ``FSDPStrategy(auto_wrap_policy={Block})`` (FSDP1, which needs an accelerator:
  with ``--device cuda`` only).

Every rank reports its peak RSS (``ru_maxrss``) after the imports (before any model) and after
``fit``; the table gives the median over ``--rounds`` of the largest rank's peak, and that peak
less the one after imports (what training added).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "recipes"))
from record import record  # noqa: E402


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _module(system: str, config: object) -> object:
    import lightning.pytorch as pl
    import torch
    from gpt_model import GPT

    class LM(pl.LightningModule):
        def configure_model(self) -> None:
            if hasattr(self, "model"):
                return
            self.model = GPT(config)
            if system == "fsdp2":
                from torch.distributed.fsdp import fully_shard
                mesh = self.device_mesh["data_parallel"]
                for block in self.model.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

        def training_step(self, batch: object, index: int) -> object:
            (x,) = batch
            return self.model(x[:, :-1].contiguous(), x[:, 1:].contiguous())

        def configure_optimizers(self) -> object:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return LM()


def _strategy(system: str, world: int) -> object:
    from gpt_model import Block
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    if system == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    if system == "fsdp":
        return FSDPStrategy(auto_wrap_policy={Block})
    import parts.integrations.lightning  # noqa: F401  registers "parts"
    return "parts"


def worker(args: argparse.Namespace) -> None:
    """One rank of one system: fit, then print this rank's peaks."""
    import warnings
    warnings.simplefilter("ignore")
    import lightning.pytorch as pl
    import torch
    from gpt_model import GPTConfig
    after_imports = _peak_mib()
    world = int(os.environ["WORLD_SIZE"])
    config = GPTConfig(vocab_size=128, block_size=64, n_layer=args.n_layer, n_head=8, n_embd=args.n_embd)
    data = torch.utils.data.TensorDataset(torch.randint(0, 128, (64, 65), generator=torch.Generator().manual_seed(0)))
    trainer = pl.Trainer(strategy=_strategy(args.system, world), accelerator=args.device, devices=world,
                         max_steps=args.steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    trainer.fit(_module(args.system, config), torch.utils.data.DataLoader(data, batch_size=2))
    print("peak " + json.dumps(dict(rank=trainer.global_rank, after_imports=after_imports, peak=_peak_mib())),
          flush=True)


def launch(args: argparse.Namespace, system: str) -> list[dict]:
    """One torchrun launch of ``system``; every rank's peaks."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.world),
               __file__, "--worker", "--system", system, "--device", args.device, "--steps", str(args.steps),
               "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{system}: {' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return [json.loads(line[len("peak "):]) for line in done.stdout.splitlines() if line.startswith("peak ")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``--worker`` is one rank of a launch)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--systems", default=None, help="comma-separated; default parts,fsdp2 (and fsdp on cuda)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", default="parts", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    default = ["parts", "fsdp2"] + (["fsdp"] if args.device == "cuda" else [])
    systems = args.systems.split(",") if args.systems else default
    peaks: dict[str, list] = {s: [] for s in systems}
    for _ in range(args.rounds):
        for system in systems:  # in turn, so that load drift hits every system alike
            peaks[system].append(max(launch(args, system), key=lambda r: r["peak"]))
    rows = [dict(system=s, peak_rss_MiB=round(statistics.median(r["peak"] for r in peaks[s]), 1),
                 added_by_training_MiB=round(statistics.median(r["peak"] - r["after_imports"] for r in peaks[s]), 1))
            for s in systems]
    for row in rows:
        print(row)
    record("bench_lightning_rss" + ("_cuda" if args.device == "cuda" else ""),
           {"rows": rows, "world": args.world, "steps": args.steps, "n_layer": args.n_layer, "n_embd": args.n_embd,
            "rounds": args.rounds})


if __name__ == "__main__":
    main()
