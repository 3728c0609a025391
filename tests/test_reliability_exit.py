"""Issue 21 row 3: a script using parts under torchrun exits 0, every time.

The cause of the spurious SIGABRT at exit: objects of parts were never freed (reference
cycles through tensor hooks held in C++, and a module -> coordinator lookup whose values kept
their keys alive), so the process group and gloo's threads outlived ``destroy_process_group``
into interpreter teardown. ``teardown_job.py`` trains a little, drops everything and checks
that no gloo thread is left after ``destroy_process_group``; several launches run side by side.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = 3  # launched together: about one launch's time on 2 cores


def launch() -> subprocess.Popen:
    """``torchrun --standalone --nproc-per-node 2 tests/teardown_job.py``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "tests" / "teardown_job.py")]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_gloo_threads_end_at_destroy_process_group_and_every_run_exits_0() -> None:
    """Before: 'gloo threads after destroy_process_group: [gloo_tcp_loop, pt_gloo_runloop, ...]'
    and exit 3 on every run (and, at random, SIGABRT at interpreter exit)."""
    runs = [launch() for _ in range(RUNS)]
    for run in runs:
        out, _ = run.communicate(timeout=240)
        assert run.returncode == 0, out[-3000:]
        assert out.count("gloo threads after destroy_process_group: []") == 2, out[-3000:]
        assert "terminate called" not in out, out[-3000:]
