"""Process groups end before the interpreter does, so a script may skip ``destroy_process_group``.

A gloo worker thread drops its reference to a finished collective's tensors just after the
caller's ``wait()`` returns; when that is the tensor's last C++ reference, the worker takes the
GIL to release the tensor's Python object. A script that ends right after a collective can reach
interpreter finalization first: CPython then ends the worker with ``pthread_exit``, whose forced
unwind through gloo's ``noexcept`` code aborts the process (``terminate called without an
active exception``). ``destroy_process_group`` joins the workers, so at a normal exit parts calls
it for the user who did not. After an uncaught exception it does not: a peer may still be waiting
in a collective, and joining would wait for gloo's timeout instead of letting the launcher see
the failure.
"""

from __future__ import annotations

import atexit
import sys

import torch.distributed as dist


def _failing() -> bool:
    """True while the interpreter exits on an uncaught exception (it set ``sys.last_value``)."""
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def end_process_groups() -> None:
    """``destroy_process_group()`` if the default group is still there and the script ended normally."""
    if dist.is_available() and dist.is_initialized() and not _failing():
        dist.destroy_process_group()


atexit.register(end_process_groups)
