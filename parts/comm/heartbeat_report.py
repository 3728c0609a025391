"""What a rank's heartbeat says about it, and the error that names a failed rank.

A heartbeat record is a small JSON object a rank posts on the store: a sequence number that
grows with each beat, the step it is at, the operation its main thread is in, its pid, host
and process namespace (``node_id``: ranks with the same one can see each other's processes),
and its state (``alive``, ``failed`` with the error it raised, ``stopped`` once it
ended cleanly). The operation is read from the main thread's Python stack
(``sys._current_frames``): its innermost frame and, where that frame is in torch or parts,
the caller outside them (``all_reduce (distributed_c10d.py:3252) from train.py:41``), so
no collective needs instrumenting.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, Optional

import torch

_PARTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, _PARTS_DIR + os.sep)
_THREADING = threading.__file__
COMM_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL", "Timed out")


class PeerFailure(RuntimeError):
    """Another rank failed: killed, stopped, hung, or raised. ``rank`` (global), ``step``,
    ``op`` and ``reason`` say which, where and how."""

    def __init__(self, message: str, *, rank: int, step: Optional[int] = None, op: str = "",
                 reason: str = "") -> None:
        super().__init__(message)
        self.rank, self.step, self.op, self.reason = rank, step, op, reason

    def __reduce__(self) -> tuple:
        return (_rebuild, (str(self), self.rank, self.step, self.op, self.reason))


def _rebuild(message: str, rank: int, step: Optional[int], op: str, reason: str) -> PeerFailure:
    return PeerFailure(message, rank=rank, step=step, op=op, reason=reason)


def _where(frame: FrameType) -> str:
    return f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"


def _in_library(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(_LIBRARY_DIRS)


def describe_frame(frame: Optional[FrameType]) -> str:
    """The innermost frame of a stack and, if it is inside torch or parts, its first caller outside."""
    while frame is not None and frame.f_code.co_filename == _THREADING:
        frame = frame.f_back
    if frame is None:
        return "no Python frame"
    text, caller = _where(frame), frame.f_back
    if _in_library(frame):
        while caller is not None and _in_library(caller):
            caller = caller.f_back
        if caller is not None:
            text += f" from {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
    return text


def main_thread_op() -> str:
    """Where the main thread is now."""
    return describe_frame(sys._current_frames().get(threading.main_thread().ident))


def raised_at(tb: Optional[TracebackType]) -> str:
    """Where an exception was raised: the innermost frame of its traceback, described."""
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return describe_frame(tb.tb_frame) if tb is not None else "unknown"


def is_comm_error(exc: BaseException) -> bool:
    """True for an error a collective raises when a peer is gone (gloo's closed connection, NCCL's)."""
    dist_error = getattr(torch.distributed, "DistError", None)
    return (dist_error is not None and isinstance(exc, dist_error)) or \
        (isinstance(exc, RuntimeError) and any(text in str(exc) for text in COMM_ERRORS))


@dataclass
class Record:
    """One rank's heartbeat."""

    rank: int
    seq: int = 0
    step: Optional[int] = None
    op: str = ""
    state: str = "alive"
    error: str = ""
    pid: int = 0
    host: str = ""
    node: str = ""

    def dumps(self) -> str:
        """The record as the store holds it."""
        return json.dumps(self.__dict__)

    @classmethod
    def loads(cls, raw: Any) -> "Record":
        """A record read from the store."""
        return cls(**json.loads(raw.decode() if isinstance(raw, bytes) else raw))

    def who(self) -> str:
        """``rank N (pid P on H)``."""
        return f"rank {self.rank} (pid {self.pid} on {self.host})"

    def at(self) -> str:
        """``step S, in OP``."""
        step = f"step {self.step}" if self.step is not None else "an unknown step"
        return f"{step}, in {self.op or 'an unknown operation'}"


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


def node_id() -> str:
    """Where this process's pids mean the same processes: host, boot and pid namespace ("" without /proc)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{socket.gethostname()}/{_read('/proc/sys/kernel/random/boot_id')}/{namespace}"


def process_state(pid: int) -> str:
    """The state of process ``pid`` as ``/proc`` gives it (``T``: stopped by a signal, ``Z``: dead),
    ``gone`` where it has no entry."""
    stat = _read(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[1].split()[0] if ")" in stat else "gone"


def new_record(rank: int) -> Record:
    """This process's first record."""
    return Record(rank=rank, pid=os.getpid(), host=socket.gethostname(), node=node_id())


def stale(record: Record, age: float) -> PeerFailure:
    """The error naming a rank that has not beaten for ``age`` seconds."""
    reason = f"sent no heartbeat for {age:.1f} s (killed, stopped or hung)"
    return PeerFailure(f"{record.who()} {reason}; its last report: {record.at()}",
                       rank=record.rank, step=record.step, op=record.op, reason=reason)


def stopped(record: Record, age: float, state: str) -> PeerFailure:
    """The error naming a rank whose process this one sees stopped (``T``) or dead."""
    how = "is stopped (SIGSTOP)" if state == "T" else "is dead"
    reason = f"{how} and sent no heartbeat for {age:.1f} s"
    return PeerFailure(f"{record.who()} {reason}; its last report: {record.at()}",
                       rank=record.rank, step=record.step, op=record.op, reason=reason)


def raised(record: Record) -> PeerFailure:
    """The error naming a rank that reported its own exception."""
    reason = f"raised {record.error}"
    return PeerFailure(f"{record.who()} {reason} at {record.at()}", rank=record.rank, step=record.step,
                       op=record.op, reason=reason)


def verdict_text(failure: PeerFailure, by: int) -> str:
    """A failure as the store's verdict key holds it (``by``: the rank that saw it)."""
    return json.dumps({"message": str(failure), "rank": failure.rank, "step": failure.step, "op": failure.op,
                       "reason": failure.reason, "by": by})


def from_verdict(raw: Any) -> PeerFailure:
    """The failure a verdict key holds."""
    v = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    return PeerFailure(f"{v['message']} (seen by rank {v['by']})", rank=v["rank"], step=v["step"], op=v["op"],
                       reason=v["reason"])
