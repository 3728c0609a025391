"""``init_process_group``: ``torch.distributed.init_process_group`` that a group restarted by
torchrun's elastic agent can join.

Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``, the default) every worker of every
restart connects to the same key-value store, the agent's, which lives as long as the job.
``init_process_group`` keys its rendezvous by the group's name, the same in every restart
(the default group of a fresh process is always the first), and nothing removes the keys of
a dead group. A restarted gloo group therefore reads the listening addresses the previous,
killed workers posted and fails in ``Gloo connectFullMesh ... Connection refused`` (NCCL's
unique id is keyed the same way).

This function gives each start of the group its own key prefix on the agent's store. The
prefix is the id rank 0 draws, agreed by a handshake that no key left by an earlier start can
fool: every rank posts a fresh token of its own; rank 0 answers each token it reads with the
token and its id; a rank accepts the id only from an answer naming its own token, then
confirms it; rank 0 goes on once every rank confirmed its id. Outside torchrun's agent store
(another launcher, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, an explicit ``store`` or
``init_method``) it is ``torch.distributed.init_process_group`` itself.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

_KEYS = "parts/launch/"
_DEFAULT_TIMEOUT = timedelta(minutes=30)  # the process group's default (torch's default_pg_timeout)


def init_process_group(backend: Optional[str] = None, *, timeout: Optional[timedelta] = None,
                       **kwargs: Any) -> None:
    """``dist.init_process_group(backend, ...)`` under a key prefix of this start's own on
    torchrun's agent store (see the module docstring); the same call elsewhere."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "store" in kwargs or "init_method" in kwargs:
        dist.init_process_group(backend, timeout=timeout, **kwargs)
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    wait = timeout or _DEFAULT_TIMEOUT
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world_size,
                          is_master=False, timeout=wait)
    start = agree_on_start(store, rank, world_size, wait)
    dist.init_process_group(backend, store=dist.PrefixStore(f"{_KEYS}start/{start}/", store), rank=rank,
                            world_size=world_size, timeout=timeout, **kwargs)


def agree_on_start(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """The id of this start of the group, the same on every rank, drawn anew by rank 0."""
    deadline = time.monotonic() + timeout.total_seconds()
    if world_size == 1:
        return uuid.uuid4().hex
    if rank == 0:
        return _lead(store, world_size, deadline)
    return _follow(store, rank, deadline)


def _key(kind: str, rank: int) -> str:
    return f"{_KEYS}{kind}/{rank}"


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _pause(tries: int) -> None:
    time.sleep(min(0.2, 0.005 * (tries + 1)))


def _lead(store: dist.Store, world_size: int, deadline: float) -> str:
    """Rank 0: answer every token posted (stale ones too) until every rank confirmed this start."""
    start, answered, tries = uuid.uuid4().hex, {}, 0
    others = list(range(1, world_size))
    hellos, joins = [_key("hello", r) for r in others], [_key("joined", r) for r in others]
    while True:
        if store.check(hellos):
            tokens = [_text(v) for v in store.multi_get(hellos)]
            fresh = [(r, t) for r, t in zip(others, tokens) if answered.get(r) != t]
            if fresh:
                store.multi_set([_key("answer", r) for r, _ in fresh], [f"{t}:{start}" for _, t in fresh])
                answered.update(fresh)
            if store.check(joins) and all(_text(v) == start for v in store.multi_get(joins)):
                return start
        _expire(deadline, "rank 0 waited for ranks 1..%d to join this start of the group" % (world_size - 1))
        _pause(tries)
        tries += 1


def _follow(store: dist.Store, rank: int, deadline: float) -> str:
    """Rank r > 0: post a fresh token, take the start id from rank 0's answer to it, confirm it."""
    token, tries = uuid.uuid4().hex, 0
    store.set(_key("hello", rank), token)
    answer = _key("answer", rank)
    while True:
        if store.check([answer]):
            mine, _, start = _text(store.get(answer)).partition(":")
            if mine == token:
                store.set(_key("joined", rank), start)
                return start
        _expire(deadline, f"rank {rank} waited for rank 0 to answer its token")
        _pause(tries)
        tries += 1


def _expire(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"parts.comm.init_process_group: {what} past the timeout (is every rank of "
                           f"WORLD_SIZE={os.environ.get('WORLD_SIZE')} started, and did each call "
                           f"parts.comm.init_process_group?)")
