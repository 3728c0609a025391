"""parts.plan: what each rank will hold and send, before renting the machines.

``dry_run(build, world_size, **knobs)`` builds the model on the meta device inside a fake
process group of ``world_size`` ranks, attaches the coordinator with the given knobs, runs a
few steps and returns a ``Plan``: per-rank bytes of parameter shards, grad shards, optimizer
state, kept-gathered and gathered-at-once full parameters, and per-step collective bytes.
``measure`` reads the same plan from a real run; ``Reference`` gives the ZeRO formulas and
DeepSpeed's estimate beside it; ``python -m parts.plan`` prints the table for a Hugging Face
config.
"""

from parts.plan.dry_run import adamw, dry_run, measure, token_step
from parts.plan.estimate import Widths, estimate
from parts.plan.layout_bytes import Plan, Reference, link_split, peers
from parts.plan.shapes import ModelShape, shape_of

__all__ = ["Plan", "Reference", "ModelShape", "Widths", "dry_run", "estimate", "measure", "shape_of",
           "link_split", "peers", "token_step", "adamw"]
