"""A script using parts under torchrun exits 0, every time.

The abort at exit (``terminate called without an active exception``, SIGABRT): a gloo worker
thread (``pt_gloo_runloop``) still releasing a finished collective's tensors takes the GIL
(torch 2.13 drops a tensor's PyObject reference when the C++ count falls to one); once the
interpreter is finalizing, CPython ends that thread with ``pthread_exit``, and the forced
unwind through the work's ``noexcept`` destructor calls ``std::terminate``. It can only happen
while the group outlives ``destroy_process_group`` (else its destructor joins the workers), and
parts objects held it: first through uncollectable cycles, then (a user keeping their model
and optimizer, or objects in ordinary cycles) through plain references. ``teardown_job.py``
checks that dropped objects are freed (``drop``) and then that no gloo thread is left after
``destroy_process_group`` with other objects still alive (``keep``), both in one launch
(``both``) at worlds 2 and 3; the launches run side by side. A script that ends without
``destroy_process_group`` (``exit``) finds no gloo thread left once the exit handlers ran:
parts destroys the process groups at a normal interpreter exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCHES = [(2, "both"), (3, "both"), (2, "exit")]  # side by side; a launch costs ~3 s of CPU per process


def launch(world: int, mode: str) -> subprocess.Popen:
    """``torchrun --standalone --nproc-per-node world tests/teardown_job.py mode``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               str(ROOT / "tests" / "teardown_job.py"), mode]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_gloo_threads_end_at_destroy_process_group_and_every_run_exits_0() -> None:
    """Before (keep): 'gloo threads after destroy_process_group: [gloo_tcp_loop, pt_gloo_runloop,
    ...]' and exit 3 on every rank (and, at random, SIGABRT at interpreter exit). Before (exit):
    'gloo threads at interpreter exit: [gloo_tcp_loop, pt_gloo_runloop, ...]', exit 3."""
    runs = [(world, mode, launch(world, mode)) for world, mode in LAUNCHES]
    for world, mode, run in runs:
        out, _ = run.communicate(timeout=240)
        assert run.returncode == 0, out[-3000:]
        said = "gloo threads at interpreter exit" if mode == "exit" else "gloo threads after destroy_process_group"
        assert out.count(f"({mode}): {said}: []") == world, out[-3000:]
        assert "terminate called" not in out, out[-3000:]
