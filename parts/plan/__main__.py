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
from typing import Any, Callable, Optional, Sequence

from parts.partition.coordinator.plan import Knobs
from parts.plan.estimate import Widths, estimate
from parts.plan.layout_bytes import Plan
from parts.plan.models import config_dtype, function_builder, hf_builder, on_meta
from parts.plan.report import report
from parts.plan.shapes import shape_of

_DTYPES = {"fp32": Widths(4, 4, 4, 8), "bf16-mixed": Widths(4, 2, 4, 8)}


def _at_least(low: float, kind: type) -> Callable[[str], Any]:
    """An argparse type: a ``kind`` number of at least ``low`` (more than 0 for floats when ``low`` is 0)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if value < low or (kind is float and value <= 0):
            raise argparse.ArgumentTypeError(f"must be {'more than 0' if kind is float else f'at least {low}'}, "
                                             f"got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m parts.plan", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a Hugging Face config.json (no weights needed)")
    source.add_argument("--model", help="module:function that builds the model")
    parser.add_argument("--world-size", type=_at_least(1, int), required=True, help="ranks")
    parser.add_argument("--ranks-per-node", type=_at_least(1, int), default=8, help="ranks sharing a node (fast link)")
    parser.add_argument("--shard-size", type=_at_least(1, int), default=None,
                        help="hybrid layout: shard within this many ranks, replicate across (default: the world)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="fp32: fp32 params, grads and AdamW; bf16-mixed: MixedPrecision() (fp32 shards, "
                             "bf16 gathers and compute). Default: bf16-mixed for a config whose torch_dtype is "
                             "bfloat16 or float16, else fp32")
    parser.add_argument("--memory-per-device", type=_at_least(0, float), default=None,
                        help="GiB each rank may use")
    parser.add_argument("--dry-run", action="store_true", help="run the code on a fake world instead of estimating")
    for name, default in (("persistence_threshold", 100_000), ("max_reuse_distance", 5_000_000),
                          ("prefetch_bucket_size", 5_000_000), ("max_live_parameters", 1_000_000_000),
                          ("fetch_unit_size", 5_000_000)):
        parser.add_argument("--" + name.replace("_", "-"), type=_at_least(0, int), default=default,
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


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """The arguments, checked together (argparse errors, exit 2); ``dtype`` resolved from the config."""
    parser = _parser()
    args = parser.parse_args(argv)
    world, per_node = args.world_size, args.ranks_per_node
    if world > per_node and world % per_node:
        parser.error(f"--world-size {world} is not a whole number of nodes of --ranks-per-node {per_node}")
    if args.shard_size is not None and world % args.shard_size:
        parser.error(f"--shard-size {args.shard_size} does not divide --world-size {world}")
    declared = config_dtype(args.config) if args.config else None
    args.note = ""
    if args.dtype is None:
        args.dtype = "bf16-mixed" if declared in ("bfloat16", "float16") else "fp32"
        if declared in ("bfloat16", "float16"):
            args.note = (f"the config's torch_dtype {declared}: planned as --dtype bf16-mixed (fp32 shards are "
                         f"the masters, bf16 gathers and compute; --dtype fp32 plans fp32 throughout)")
    elif declared not in (None, "float32"):
        args.note = f"the config's torch_dtype {declared}: planned as --dtype {args.dtype}, as given"
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse, plan, print; exit 1 if the plan does not fit ``--memory-per-device``."""
    args = _parse(argv)
    if args.note:
        print(args.note, file=sys.stdout)
    build = hf_builder(args.config) if args.config else function_builder(args.model)
    shape = shape_of(on_meta(build))
    plan = _plan(args, build, _knobs(args))
    fits = report(plan, shape, args.ranks_per_node, _DTYPES[args.dtype], args.memory_per_device,
                  title=args.config or args.model, out=sys.stdout)
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
