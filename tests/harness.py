"""A pool of gloo worker processes that runs test bodies on 1..4 ranks.

Starting a rank that imports torch costs seconds with ``spawn`` but about
0.1 s with ``fork``, and a suite of hundreds of distributed cases (hypothesis
examples included) must not pay even that per case. So each world size gets a
pool of forked workers that live for the whole pytest session, each with its own
process group. ``run`` pickles a module-level test function (by reference) and
its arguments to every rank and returns each rank's return value.

A rank that raises, dies or times out fails the test with that rank's
traceback; the pool of that world size is then torn down and forked anew, since
its process group may be stuck inside a half-finished collective.
"""

from __future__ import annotations

import gc
import importlib.util
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

MAX_WORLD_SIZE = 4
DEFAULT_TIMEOUT = 60.0
_GRACE_AFTER_FAILURE = 2.0  # seconds the other ranks get to finish after one rank failed


class RankFailure(AssertionError):
    """A rank raised, died or timed out; the message holds its traceback."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _resolve(module_name: str, qualname: str, path: str | None) -> Callable:
    """Find a test function in a worker; import its module from ``path`` if it is new."""
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _reset_torch_state(torch: Any) -> None:
    """Undo process-wide torch settings a test body may have changed."""
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)


def _drop_garbage() -> None:
    """Collect what the job left in reference cycles, now and on every rank alike.

    An attached model dropped without ``detach`` lives in a cycle until a collection; its
    coordinator still follows every optimizer step (a process-wide hook) and may issue a
    collective there. Collections run at allocation counts that differ between ranks, so one
    rank could still hold it in the next job and issue a collective the other ranks never
    join. Freezing the survivors keeps the next collection to the objects newer than them.
    """
    gc.collect()
    gc.freeze()


def _worker_main(rank: int, world_size: int, port: int, conn: Any) -> None:
    """Body of one worker: join the process group, then run jobs until told to stop."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # forked children must not reuse the parent's OpenMP pool
    signal.signal(signal.SIGINT, signal.default_int_handler)  # not a handler the pytest process was given
    # as in the recipes: no flight-recorder record per collective, so a rank's heap in use is flat
    # from step to step and a soak test sees what parts allocates
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    conn.send(("ready", None))
    while True:
        job = conn.recv()
        if job is None:
            break
        try:
            fn_ref, args, kwargs = pickle.loads(job)
            result = ("ok", pickle.dumps(_resolve(*fn_ref)(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the parent
            result = ("error", traceback.format_exc())
        _reset_torch_state(torch)
        _drop_garbage()
        conn.send(result)
    dist.destroy_process_group()


@dataclass
class _Pool:
    """Workers of one world size, and the parent's ends of their pipes."""

    world_size: int
    processes: list = field(default_factory=list)
    conns: list = field(default_factory=list)

    def start(self) -> None:
        ctx = mp.get_context("fork")
        port = _free_port()
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, self.world_size, port, child_end),
                               daemon=True, name=f"parts-test-rank{rank}-of{self.world_size}")
            proc.start()
            child_end.close()
            self.processes.append(proc)
            self.conns.append(parent_end)
        for rank in range(self.world_size):
            self._receive(rank, time.monotonic() + 120.0, "start-up")

    def _receive(self, rank: int, deadline: float, what: str) -> tuple:
        conn, proc = self.conns[rank], self.processes[rank]
        while not conn.poll(0.01):
            if not proc.is_alive():
                raise RankFailure(f"rank {rank} of {self.world_size} died during {what} "
                                  f"(exit code {proc.exitcode})", rank)
            if time.monotonic() > deadline:
                raise RankFailure(f"rank {rank} of {self.world_size} timed out during {what}", rank)
        try:
            return conn.recv()
        except EOFError:
            proc.join(1.0)
            raise RankFailure(f"rank {rank} of {self.world_size} died during {what} "
                              f"(exit code {proc.exitcode})", rank) from None

    def run(self, job: bytes, timeout: float, what: str) -> list:
        for conn in self.conns:
            conn.send(job)
        deadline = time.monotonic() + timeout
        results: list = [None] * self.world_size
        failures: list[RankFailure] = []
        pending = set(range(self.world_size))
        while pending:
            rank = self._next_ready(pending, deadline, failures)
            if rank is None:
                break
            pending.discard(rank)
            try:
                status, payload = self._receive(rank, deadline, what)
            except RankFailure as failure:
                failures.append(failure)
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE)
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                failures.append(RankFailure(f"rank {rank} of {self.world_size} raised in {what}:\n"
                                            f"{payload}", rank))
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE)
        if failures or pending:
            self.stop(force=True)
            raise _summarise(failures, pending, self.world_size, what, timeout)
        return results

    def _next_ready(self, pending: set, deadline: float, failures: list) -> int | None:
        """Wait for a pending rank that has answered or died; None on timeout."""
        while time.monotonic() < deadline:
            for rank in sorted(pending):
                if self.conns[rank].poll() or not self.processes[rank].is_alive():
                    return rank
            time.sleep(0.001)
        return None

    def stop(self, force: bool = False) -> None:
        for conn, proc in zip(self.conns, self.processes):
            if not force and proc.is_alive():
                try:
                    conn.send(None)
                except OSError:
                    pass
        for proc in self.processes:
            proc.join(None if not force else 0.1)
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join()
        for conn in self.conns:
            conn.close()
        self.processes.clear()
        self.conns.clear()


def _summarise(failures: list, pending: set, world_size: int, what: str,
               timeout: float) -> RankFailure:
    """One RankFailure whose message leads with the first failing rank's traceback."""
    parts = [str(failure) for failure in failures]
    first = failures[0].rank if failures else None
    if pending and not failures:
        parts.append(f"ranks {sorted(pending)} of {world_size} timed out after {timeout:.0f} s in {what}")
    elif pending:
        parts.append(f"ranks {sorted(pending)} did not finish after the failure (likely blocked "
                     f"in a collective the failing rank never joined)")
    return RankFailure("\n".join(parts), first)


_POOLS: dict[int, _Pool] = {}


def _pool(world_size: int) -> _Pool:
    pool = _POOLS.get(world_size)
    if pool is None or not pool.processes:
        pool = _Pool(world_size)
        pool.start()
        _POOLS[world_size] = pool
    return pool


def run(world_size: int, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT,
        **kwargs: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn`` must be a module-level function (it is pickled by reference); the
    default process group spans exactly these ranks.
    """
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be in 1..{MAX_WORLD_SIZE}, got {world_size}")
    module = sys.modules.get(fn.__module__)
    path = getattr(module, "__file__", None)
    job = pickle.dumps(((fn.__module__, fn.__qualname__, path), args, kwargs))
    what = f"{fn.__qualname__} at world {world_size}"
    return _pool(world_size).run(job, timeout, what)


def shutdown() -> None:
    """Stop every pool (called once at the end of the pytest session)."""
    for pool in _POOLS.values():
        pool.stop()
    _POOLS.clear()
