"""The planner's table: memory per rank by kind, traffic per step by link, the references."""

from __future__ import annotations

from typing import Optional, TextIO

from parts.plan.estimate import Widths, model_states_at, smallest_world
from parts.plan.layout_bytes import GIB, Plan, Reference, link_split, peers
from parts.plan.shapes import ModelShape


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def _size(n: float) -> str:
    """Bytes in the largest of GiB, MiB, KiB that shows them as at least 0.01 (advice lines)."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20)):
        if n >= scale / 100:
            return f"{n / scale:,.2f} {unit}"
    return f"{n / 1024:,.2f} KiB"


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def memory_rows(plan: Plan) -> list[tuple[str, int, int, int]]:
    """(what, bytes per rank in memory, with optimizer state on disk, with shards on disk too),
    activations excluded: ``OffloadedOptimizer`` moves the state, a ``DiskStore`` the shards."""
    rows = [("parameter shards", plan.param_bytes, plan.param_bytes, 0),
            ("gradient shards", plan.grad_bytes, plan.grad_bytes, plan.grad_bytes),
            ("optimizer state", plan.optimizer_bytes, 0, 0),
            ("small parameters kept gathered", plan.persistent_bytes, plan.persistent_bytes, plan.persistent_bytes),
            ("full parameters gathered at once (peak)", plan.gathered_peak_bytes, plan.gathered_peak_bytes,
             plan.gathered_peak_bytes)]
    return rows + [("total (no activations)", *(sum(r[k] for r in rows) for k in (1, 2, 3)))]


def traffic_rows(plan: Plan, ranks_per_node: int) -> list[tuple[str, int, int]]:
    """(collective, bytes inside the node, bytes between nodes) per rank and step."""
    k = plan.shard_size or plan.world_size
    shard_peers = peers(plan.world_size, k, ranks_per_node, replicas=False)
    replica_peers = peers(plan.world_size, k, ranks_per_node, replicas=True)
    rows = [(name, *link_split(nbytes, *group)) for name, nbytes, group in (
        ("all-gather (received)", plan.allgather_bytes, shard_peers),
        ("reduce-scatter (sent)", plan.reduce_scatter_bytes, shard_peers),
        ("all-reduce across replicas", plan.all_reduce_bytes, replica_peers))]
    inside, between = (sum(r[i] for r in rows) for i in (1, 2))
    return rows + [("total", inside, between)]


def advice(plan: Plan, limit: Optional[float], shape: Optional[ModelShape] = None,
           widths: Optional[Widths] = None, ranks_per_node: int = 8) -> list[str]:
    """What to change when the plan does not fit ``limit`` GiB: the biggest movable kinds first, each
    worth at least 1% of the peak; with ``shape`` and ``widths``, the smallest world size that fits."""
    if limit is None or plan.peak_bytes <= limit * GIB:
        return []
    over = plan.peak_bytes - limit * GIB
    moves = [(plan.optimizer_bytes, "offload optimizer state to disk (parts.offload.OffloadedOptimizer): {} "
                                    "leaves memory"),
             (plan.param_bytes, "shards on disk too (partitioned(remote_device=DiskStore(...))): another {} "
                                "leaves memory"),
             (plan.persistent_bytes, "persistence_threshold=0: {} of kept full copies leave memory")]
    lines = [f"does not fit: {_size(plan.peak_bytes)} > {limit:g} GiB (over by {_size(over)})"]
    lines += ["- " + text.format(_size(nbytes)) for nbytes, text in moves if nbytes >= plan.peak_bytes / 100]
    if shape is not None and widths is not None and (plan.shard_size or plan.world_size) == plan.world_size:
        lines.append(_more_ranks(plan, shape, widths, limit, ranks_per_node))
    return lines


def _more_ranks(plan: Plan, shape: ModelShape, widths: Widths, limit: float, ranks_per_node: int) -> str:
    """The advice line on the world size: the smallest that fits, or why none does."""
    fixed = plan.persistent_bytes + plan.gathered_peak_bytes
    world = smallest_world(shape, widths, fixed, limit * GIB, plan.world_size, ranks_per_node)
    if world is None:
        return (f"- more ranks cannot make it fit: {_size(fixed)} (full parameters kept or gathered at once) "
                f"does not shrink with the world size")
    return (f"- more ranks: --world-size {world} is the smallest that fits "
            f"({_size(fixed + model_states_at(shape, world, widths))} per rank)")


def zero_reference(params: int, world_size: int, widths: Widths) -> Reference:
    """The ZeRO paper's formulas for the planned widths. Mixed precision (gathers narrower than
    the shards): params and grads in the compute dtype, the fp32 masters in the optimizer state
    (2, 2 and K = 12 bytes with AdamW). Otherwise all in the shard dtype (fp32 AdamW: 4, 4, 8)."""
    mixed = widths.compute < widths.param
    return Reference(params, world_size, param_bytes=widths.compute if mixed else widths.param,
                     state_bytes=widths.state + (widths.param if mixed else 0))


def _references(plan: Plan, shape: ModelShape, widths: Widths, out: TextIO) -> None:
    """The reference rows: the ZeRO paper's formulas for the planned widths, and DeepSpeed's estimate."""
    ref, largest = zero_reference(plan.params, plan.world_size, widths), shape.largest_module()
    print(f"\nmodel states per rank, for reference (ZeRO paper formulas at {ref.param_bytes} + {ref.param_bytes} + "
          f"{ref.state_bytes} bytes per parameter; DeepSpeed's estimate)", file=out)
    for name, nbytes in (("DDP", ref.ddp()), ("ZeRO-1", ref.zero1()), ("ZeRO-2", ref.zero2()),
                         ("ZeRO-3", ref.zero3()), ("parts (this plan)", plan.model_state_bytes),
                         ("DeepSpeed estimate_zero3 (GPU, no offload)", ref.deepspeed_estimate(largest))):
        print(f"  {name:<44} {_gib(nbytes):>14}", file=out)
    per_param, extra = 2 * ref.param_bytes + ref.state_bytes, ref.deepspeed_estimate(0) - ref.zero3()
    print(f"  DeepSpeed: 18 bytes per parameter / N where ZeRO-3 has {per_param} (+{_gib(extra)}), plus 4 bytes x "
          f"the largest module's {largest:,} elements (+{_gib(4 * largest)}); its 1.5 buffer factor is for CPU "
          f"memory only", file=out)


def report(plan: Plan, shape: ModelShape, ranks_per_node: int, widths: Widths, limit: Optional[float],
           *, title: str, out: TextIO) -> bool:
    """Print the table for ``plan``; True if it fits ``limit`` GiB per rank (or no limit given)."""
    w, k = plan.world_size, max(1, min(ranks_per_node, plan.world_size))
    layout = ("full sharding" if (plan.shard_size or w) == w else
              f"hybrid: sharded within {plan.shard_size} ranks, {w // plan.shard_size} replicas")
    print(f"{title}: {plan.params / 1e9:,.3f} B parameters, world {w} "
          f"({-(-w // k)} nodes x {k} ranks), parts {layout}", file=out)
    print(f"\n{'memory per rank':<42} {'in memory':>14} {'optim on disk':>14} {'+ shards on disk':>16}", file=out)
    for what, *sizes in memory_rows(plan):
        print(f"  {what:<40} " + " ".join(f"{_gib(n):>14}" for n in sizes), file=out)
    print(f"\n{'traffic per rank and step':<30} {'inside node':>12} {'between nodes':>14}", file=out)
    for what, inside, between in traffic_rows(plan, k):
        print(f"  {what:<28} {_gb(inside):>12} {_gb(between):>14}", file=out)
    _references(plan, shape, widths, out)
    lines = advice(plan, limit, shape, widths, max(1, ranks_per_node))
    for line in lines:
        print(("\n" if line is lines[0] else "") + line, file=out)
    if limit is not None and not lines:
        print(f"\nfits: {_gib(plan.peak_bytes)} <= {limit:g} GiB per rank, before activations", file=out)
    return not lines
