"""Host overhead of the coordinator's hooks, and how much injected communication prefetch hides.

    python benchmarks/bench_overlap.py                          # both tables (about 1.5 min on 2 idle cores)
    python benchmarks/bench_overlap.py --only overhead --modules 400 --steps 50
    python benchmarks/bench_overlap.py --only prefetch --delays-ms 0,10,40 --link serial
    python benchmarks/bench_overlap.py --device cuda   # on GPUs (NCCL for world 2); records ..._cuda

1. ``host_overhead``: world 1 (no process group: every collective is a local copy; on a GPU a
   one-rank NCCL group, so the copies stay on the GPU), a stack of tiny ``nn.Linear`` layers
   so the hooks dominate. Median forward+backward step time of
   the plain model, of parts with every parameter persistent (hooks only, no fetch) and of
   parts fetching and releasing around every call; the difference to plain divided by the
   module calls per step (forward and backward of every Linear: the trace of the fetching
   setting). With every parameter persistent no Linear is hooked, so that setting's cost is
   the step's refresh and grad handling spread over the same calls.
2. ``prefetch_hiding``: world 2, gloo (NCCL on GPUs). The all-gather of
   ``parts.partition.core.gather`` is replaced, inside each worker, by one that takes ``delay``
   more seconds of wall time: a blocking call sleeps after the real one, an async call returns
   a handle whose ``wait()`` returns no earlier than issue time + delay (``--link parallel``:
   concurrent transfers overlap each other, pure latency) or queues behind the previous
   transfer (``--link serial``: one link, transfers back to back). The GPT of
   recipes/gpt_model.py trains with every block fetched in forward and backward, prefetch off
   and on, one step of every cell in turn (so load drift hits all cells alike); the losses with
   prefetch off and on must agree.
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import devices  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402
from record import record  # noqa: E402

SETTINGS = ("plain", "persistent", "fetch_release")


# ------------------------------------------------------------------ 1. host overhead
def _tiny_stack(modules: int, width: int) -> nn.Sequential:
    """``modules`` tiny Linear layers: almost no compute per hooked call."""
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(modules)])


def _overhead_model(setting: str, modules: int, width: int, device: torch.device) -> tuple[nn.Module, list, Any]:
    """The tiny-layer stack for ``setting``: model, tensors whose grads to clear, coordinator."""
    from parts.partition import attach, partitioned, shards
    torch.manual_seed(0)
    if setting == "plain":
        model = _tiny_stack(modules, width).to(device)
        return model, list(model.parameters()), None
    if setting == "fsdp2":  # every Linear a fully_shard unit (and the root), world 1
        from torch.distributed.fsdp import fully_shard
        model = _tiny_stack(modules, width).to(device)
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        return model, list(model.parameters()), None
    with partitioned(device=device):
        model = _tiny_stack(modules, width)
    # fetch_unit_size=0: every Linear hooked on its own, so a step makes one hooked call per module
    knobs = (dict(persistence_threshold=1 << 40, fetch_unit_size=0) if setting == "persistent"
             else dict(persistence_threshold=0, max_reuse_distance=0, fetch_unit_size=0))
    return model, shards(model), attach(model, **knobs)


def _one_step(model: nn.Module, grads: list, x: torch.Tensor) -> float:
    """Seconds for one forward+backward (grads cleared inside, as a training loop would)."""
    devices.sync(x.device)
    started = time.perf_counter()
    model(x).sum().backward()
    for t in grads:
        t.grad = None
    devices.sync(x.device)
    return time.perf_counter() - started


def _world_of_one(device: torch.device) -> bool:
    """Start a one-rank group (gloo; NCCL on a GPU, whose collectives then stay on it); True if
    this call started it."""
    if dist.is_initialized():
        return False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if device.type == "cuda":
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    return True


def host_overhead(modules: int = 200, width: int = 16, batch: int = 4, steps: int = 40,
                  warmup: int = 3, fsdp2: bool = False, device: str = "cpu") -> dict[str, dict]:
    """Median step time per setting and the added µs per module call (world 1, on ``device``);
    with ``fsdp2`` also FSDP2 with every Linear a unit, its cost per call over the same calls."""
    settings = SETTINGS + (("fsdp2",) if fsdp2 else ())
    where = devices.pick(device)
    started = _world_of_one(where) if fsdp2 or where.type == "cuda" else False
    try:
        return _measure_overhead(settings, modules, width, batch, steps, warmup, where)
    finally:
        if started:
            dist.destroy_process_group()


def _measure_overhead(settings: tuple, modules: int, width: int, batch: int, steps: int,
                      warmup: int, device: torch.device) -> dict[str, dict]:
    """The timing loop of ``host_overhead``."""
    built = {s: _overhead_model(s, modules, width, device) for s in settings}
    x, = devices.to(device, torch.randn(batch, width))
    times: dict[str, list] = {s: [] for s in settings}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for round_ in range(warmup + steps):  # interleaved, so drift hits every setting alike
            for s, (model, grads, _) in built.items():
                elapsed = _one_step(model, grads, x)
                if round_ >= warmup:
                    times[s].append(elapsed)
    finally:
        torch.set_num_threads(threads)
    plain = statistics.median(times["plain"])
    rows = {}
    same_calls = built["fetch_release"][2].stats().trace_events  # FSDP2 hooks the same calls
    for s, (model, _, coordinator) in built.items():
        step = statistics.median(times[s])
        calls = coordinator.stats().trace_events if coordinator is not None else 0
        calls = same_calls if s == "fsdp2" else calls
        per_call = (step - plain) / same_calls * 1e6 if s != "plain" else None
        rows[s] = dict(step=step, calls=calls, per_call_us=per_call)
        if coordinator is not None:
            coordinator.detach()
    return rows


# ---------------------------------------------------------------- 2. prefetch hiding
class _Link:
    """When the simulated link is next free (``serial``) or nothing (``parallel``)."""

    def __init__(self, serial: bool) -> None:
        self.serial, self.busy_until = serial, 0.0

    def due(self, issued: float, delay: float) -> float:
        """Wall time at which a transfer issued at ``issued`` completes."""
        start = max(issued, self.busy_until) if self.serial else issued
        self.busy_until = start + delay
        return start + delay


class _SlowWork:
    """An async all-gather that completes no earlier than ``due`` (a transfer in the background)."""

    def __init__(self, work: Any, due: float) -> None:
        self._work, self._due = work, due

    def wait(self) -> bool:
        """Wait for the real collective, then for the simulated transfer."""
        if self._work is not None:
            self._work.wait()
        _sleep_until(self._due)
        return True


def _sleep_until(due: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``due``."""
    left = due - time.perf_counter()
    if left > 0:
        time.sleep(left)


class _SlowGather:
    """The real all-gather plus ``delay`` seconds of simulated transfer per call (settable)."""

    def __init__(self, real: Callable, serial: bool) -> None:
        self.real, self.serial, self.delay, self.link = real, serial, 0.0, _Link(serial)

    def set_delay(self, delay: float) -> None:
        """Use ``delay`` from now on, on an idle link."""
        self.delay, self.link = delay, _Link(self.serial)

    def __call__(self, outs: list, ins: list, info: Any, async_op: bool = False) -> Any:
        issued = time.perf_counter()
        work = self.real(outs, ins, info, async_op=async_op)
        if self.delay <= 0:
            return work
        due = self.link.due(issued, self.delay)
        if async_op:
            return _SlowWork(work, due)
        _sleep_until(due)
        return work


def _build_cell(config: GPTConfig, prefetch: bool, rank: int, device: torch.device) -> dict:
    """A fresh GPT (same seed for every cell) with every block fetched per use, and its optimizer."""
    from parts.partition import attach, partitioned, shards
    torch.manual_seed(0)
    with partitioned(device=device):
        model = GPT(config)
    knobs = dict(persistence_threshold=0, max_reuse_distance=0)
    coordinator = attach(model, **knobs, **({} if prefetch else dict(prefetch_bucket_size=0)))
    return dict(model=model, coordinator=coordinator, device=device, gen=torch.Generator().manual_seed(1000 + rank),
                optimizer=torch.optim.AdamW(shards(model), lr=3e-4), times=[], loss=None)


def _cell_step(cell: dict, config: GPTConfig, batch: int) -> None:
    """One training step of ``cell`` (same batches in every cell); records its time and loss."""
    inputs, targets = (torch.randint(config.vocab_size, (batch, config.block_size),
                                     generator=cell["gen"]) for _ in range(2))
    inputs, targets = devices.to(cell["device"], inputs, targets)
    devices.sync(cell["device"])
    started = time.perf_counter()
    loss = cell["model"](inputs, targets)
    loss.backward()
    cell["optimizer"].step()
    cell["optimizer"].zero_grad(set_to_none=True)
    devices.sync(cell["device"])
    cell["times"].append(time.perf_counter() - started)
    cell["loss"] = loss.item()


def _summary(cell: dict) -> dict:
    """Median step time (after the trace-recording step and the first replay), stats, loss."""
    stats = cell["coordinator"].stats()
    cell["coordinator"].detach()
    return dict(step=statistics.median(cell["times"][2:] or cell["times"]),
                gathers=stats.allgather_calls, fetches=stats.fetches,
                prefetch_hits=stats.prefetch_hits, loss=cell["loss"])


def _hiding_worker(rank: int, world: int, port: int, cells: list, config: GPTConfig,
                   opts: dict, results: Any) -> None:
    """One rank: train every (delay, prefetch) cell, one step of each in turn (drift hits all alike)."""
    torch.set_num_threads(1)
    device = devices.init_spawned(opts["device"], rank, world, port)  # gloo, or NCCL on GPU ``rank``
    gather_module = importlib.import_module("parts.partition.core.gather")  # not the `gather` function
    real = gather_module.all_gather_many
    slow = gather_module.all_gather_many = _SlowGather(real, opts["serial"])
    try:
        state = {(d, p): _build_cell(config, p, rank, device) for d, p in cells}
        for _ in range(opts["steps"]):
            for (delay, _), cell in state.items():
                slow.set_delay(delay)
                dist.barrier()
                _cell_step(cell, config, opts["batch"])
        for key, cell in state.items():
            row = _summary(cell)
            if rank == 0:
                results[key] = row
    finally:
        gather_module.all_gather_many = real
        dist.destroy_process_group()


def _free_port() -> int:
    """A TCP port free on localhost right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prefetch_hiding(delays: tuple = (0.0, 0.02), steps: int = 16, n_layer: int = 6, n_embd: int = 128,
                    seq: int = 64, batch: int = 4, vocab: int = 128, world_size: int = 2,
                    serial: bool = False, device: str = "cpu") -> dict[tuple, dict]:
    """Median step time, gathers per step and loss per (delay, prefetch) cell; raises if losses differ."""
    config = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=n_layer, n_head=4, n_embd=n_embd)
    cells = [(d, p) for d in delays for p in (False, True)]
    results = mp.Manager().dict()
    opts = dict(steps=steps, batch=batch, serial=serial, device=device)
    mp.spawn(_hiding_worker, args=(world_size, _free_port(), cells, config, opts, results),
             nprocs=world_size)
    rows = {cell: dict(results[cell]) for cell in cells}
    for delay in delays:
        off, on = (torch.tensor(rows[(delay, p)]["loss"], dtype=torch.float32) for p in (False, True))
        if not torch.equal(off, on):  # fp32 loss -> python float -> fp32 is exact
            raise RuntimeError(f"prefetch_hiding: delay {delay * 1e3:g} ms: final loss with prefetch "
                               f"off {off.item()!r} != on {on.item()!r}")
    return rows


# ------------------------------------------------------------------------- report
def _print_overhead(rows: dict[str, dict], args: argparse.Namespace) -> list[dict]:
    print(f"\n### Host overhead: {args.modules} x Linear({args.width},{args.width}), batch "
          f"{args.batch_overhead}, world 1, median of {args.steps_overhead} steps\n")
    print("| setting | step (ms) | hooked calls / step | added per module call (µs) |")
    print("|---|---|---|---|")
    table = []
    for setting, row in rows.items():
        cost = "-" if row["per_call_us"] is None else f"{row['per_call_us']:.1f}"
        print(f"| {setting} | {row['step'] * 1e3:.2f} | {row['calls'] or '-'} | {cost} |")
        table.append({"setting": setting, "step_ms": round(row["step"] * 1e3, 2),
                      "hooked_calls_per_step": row["calls"] or "-", "added_us_per_module_call": cost})
    return table


def _print_hiding(rows: dict[tuple, dict], args: argparse.Namespace) -> list[dict]:
    print(f"\n### Prefetch hiding: GPT n_layer {args.n_layer}, n_embd {args.n_embd}, seq {args.seq}, "
          f"batch {args.batch}, world 2, {args.link} link, median of steps 3..{args.steps}\n")
    print("| delay (ms) | prefetch | step (ms) | all-gathers / step | prefetch hits / fetches "
          "| added vs 0 ms (ms) | delay hidden | final loss |")
    print("|---|---|---|---|---|---|---|---|")
    base = min(rows)[0]
    table = []
    for (delay, prefetch), row in sorted(rows.items()):
        added = row["step"] - rows[(base, prefetch)]["step"]
        added_off = rows[(delay, False)]["step"] - rows[(base, False)]["step"]
        hidden = f"{1 - added / added_off:.0%}" if prefetch and delay > base and added_off > 0 else "-"
        print(f"| {delay * 1e3:g} | {'on' if prefetch else 'off'} | {row['step'] * 1e3:.1f} | "
              f"{row['gathers']} | {row['prefetch_hits']} / {row['fetches']} | {added * 1e3:.1f} | "
              f"{hidden} | {row['loss']:.6f} |")
        table.append({"delay_ms": round(delay * 1e3, 3), "prefetch": "on" if prefetch else "off",
                      "step_ms": round(row["step"] * 1e3, 1), "all_gathers_per_step": row["gathers"],
                      "prefetch_hits_of_fetches": f"{row['prefetch_hits']} / {row['fetches']}",
                      "added_vs_0ms_ms": round(added * 1e3, 1), "delay_hidden": hidden})
    print("\nfinal losses with prefetch on and off: identical (torch.equal) at every delay")
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``args.device`` comes back resolved to ``cpu`` or ``cuda``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("overhead", "prefetch"), default=None)
    parser.add_argument("--modules", type=int, default=200)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch-overhead", type=int, default=4)
    parser.add_argument("--steps-overhead", type=int, default=40)
    parser.add_argument("--delays-ms", default="0,20")
    parser.add_argument("--link", choices=("parallel", "serial"), default="parallel")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    return devices.parse_with_device(parser, argv)


def main() -> None:
    """Run the tables asked for, print and record them."""
    args = parse_args()
    suffix = "_cuda" if args.device == "cuda" else ""
    if args.only != "prefetch":
        table = _print_overhead(host_overhead(args.modules, args.width, args.batch_overhead,
                                              args.steps_overhead, device=args.device), args)
        record("bench_overlap_overhead" + suffix, {"rows": table, "summary": {
            "model": f"{args.modules} x Linear({args.width}, {args.width}), world 1"}})
    if args.only != "overhead":
        delays = tuple(float(d) / 1e3 for d in args.delays_ms.split(","))
        rows = prefetch_hiding(delays, args.steps, args.n_layer, args.n_embd, args.seq, args.batch,
                               serial=args.link == "serial", device=args.device)
        record("bench_overlap_prefetch" + suffix, {"rows": _print_hiding(rows, args), "summary": {
            "model": f"GPT {args.n_layer} layers x {args.n_embd}, world 2, {args.link} link",
            "final losses with prefetch on and off": "identical (torch.equal)"}})


if __name__ == "__main__":
    main()
