"""``python -m parts.plan``: what each rank holds and sends for a model, before renting the machines.

    python -m parts.plan --config llama70b.json --world-size 1024 --ranks-per-node 8
    python -m parts.plan --model mypkg.models:build --world-size 64 --memory-per-device 80

Prints per-rank memory by kind and per-step traffic inside and between nodes for parts'
full sharding (from ``estimate``: arithmetic on the shapes, no process group; ``--dry-run``
runs the real code on a fake world instead), whether it fits ``--memory-per-device``, what
to change if not, and the ZeRO formulas and DeepSpeed's estimate beside it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from parts.partition.coordinator.plan import Knobs
from parts.plan.estimate import Widths, estimate
from parts.plan.layout_bytes import Plan
from parts.plan.models import function_builder, hf_builder, on_meta
from parts.plan.report import report
from parts.plan.shapes import shape_of

_DTYPES = {"fp32": Widths(4, 4, 4, 8), "bf16-mixed": Widths(4, 2, 4, 8)}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m parts.plan", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a Hugging Face config.json (no weights needed)")
    source.add_argument("--model", help="module:function that builds the model")
    parser.add_argument("--world-size", type=int, required=True, help="ranks")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="ranks sharing a node (fast link)")
    parser.add_argument("--shard-size", type=int, default=None,
                        help="hybrid layout: shard within this many ranks, replicate across (default: the world)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32",
                        help="fp32: fp32 params, grads and AdamW; bf16-mixed: MixedPrecision() (bf16 gathers)")
    parser.add_argument("--memory-per-device", type=float, default=None, help="GiB each rank may use")
    parser.add_argument("--dry-run", action="store_true", help="run the code on a fake world instead of estimating")
    for name, default in (("persistence_threshold", 100_000), ("max_reuse_distance", 5_000_000),
                          ("prefetch_bucket_size", 5_000_000), ("max_live_parameters", 1_000_000_000),
                          ("fetch_unit_size", 5_000_000)):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default,
                            help="coordinator knob (elements)")
    return parser


def _knobs(args: argparse.Namespace) -> Knobs:
    return Knobs(prefetch_bucket_size=args.prefetch_bucket_size, max_reuse_distance=args.max_reuse_distance,
                 max_live_parameters=args.max_live_parameters, persistence_threshold=args.persistence_threshold,
                 fetch_unit_size=args.fetch_unit_size)


def _plan(args: argparse.Namespace, build, knobs: Knobs) -> Plan:
    if not args.dry_run:
        return estimate(shape_of(on_meta(build)), args.world_size, knobs, _DTYPES[args.dtype],
                        shard_size=args.shard_size)
    from parts.partition import MixedPrecision
    from parts.plan.dry_run import dry_run

    precision = MixedPrecision() if args.dtype == "bf16-mixed" else None
    return dry_run(build, args.world_size, mixed_precision=precision, shard_size=args.shard_size, **vars(knobs))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse, plan, print; exit 1 if the plan does not fit ``--memory-per-device``."""
    args = _parser().parse_args(argv)
    build = hf_builder(args.config) if args.config else function_builder(args.model)
    shape = shape_of(on_meta(build))
    plan = _plan(args, build, _knobs(args))
    fits = report(plan, shape, args.ranks_per_node, _DTYPES[args.dtype], args.memory_per_device,
                  title=args.config or args.model, out=sys.stdout)
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
