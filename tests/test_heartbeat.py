"""parts.comm.Heartbeat: when one rank is SIGKILLed, SIGSTOPped or raises, every other rank
raises PeerFailure within 10 s naming that rank, its step and the operation it was in (a rank
of the same host seen stopped in /proc: within 3 s, and it is sent SIGKILL); a rank in a long
step is never reported. The harness ranks run Python between steps (no
collective: a gloo collective waiting for a stopped peer cannot be interrupted; the torchrun
test covers that case through the exit). A SIGKILL is tested on workers started by hand: the
harness, like torchrun's agent, ends the other ranks of a job as soon as one dies."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import RankFailure, run

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 10.0
STOPPED_LIMIT_S = 3.0  # a stopped rank of this host: two missed beats (1 s) and the next look


def forward_pass(seconds: float) -> None:
    """A step's work, spent in Python (the heartbeat reports this function as the operation)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.02)


def misbehave(kind: str, folder: str) -> None:
    """What the victim does at its step 3, after its heartbeat has reported it in forward_pass."""
    forward_pass(1.5)
    Path(folder, "victim.json").write_text(json.dumps({"time": time.time(), "pid": os.getpid()}))
    if kind == "exception":
        raise ValueError("the victim raised on purpose")
    os.kill(os.getpid(), signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP)
    forward_pass(60.0)


def watch(kind: str, victim: int, folder: str) -> None:
    import torch.distributed as dist
    from parts.comm import Heartbeat, PeerFailure
    rank, outcome = dist.get_rank(), {"raised": None}
    try:
        with Heartbeat(exit_after=None) as beat:
            for step in range(200):
                beat.at_step(step)
                if rank == victim and step == 3:
                    misbehave(kind, folder)
                forward_pass(0.1)
    except PeerFailure as failure:
        told = json.loads(Path(folder, "victim.json").read_text())
        outcome = {"raised": "PeerFailure", "rank": failure.rank, "step": failure.step, "op": failure.op,
                   "message": str(failure), "after_s": time.time() - told["time"]}
        if kind == "sigstop" and rank == min(set(range(dist.get_world_size())) - {victim}):
            with contextlib.suppress(ProcessLookupError):  # ended already by the heartbeat that named it
                os.kill(told["pid"], signal.SIGKILL)
    Path(folder, f"rank{rank}.json").write_text(json.dumps(outcome))


@pytest.mark.parametrize("kind,world,victim", [("exception", 2, 1), ("exception", 3, 2), ("sigstop", 2, 1),
                                               ("sigstop", 3, 2)])
def test_every_other_rank_raises_within_10_s_naming_the_failed_rank_its_step_and_operation(
        tmp_path: Path, kind: str, world: int, victim: int) -> None:
    with pytest.raises(RankFailure) as failed:
        run(world, watch, kind, victim, str(tmp_path), timeout=90)
    assert failed.value.rank == victim, str(failed.value)
    for rank in set(range(world)) - {victim}:
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["raised"] == "PeerFailure", (rank, seen)
        assert (seen["rank"], seen["step"]) == (victim, 3), (rank, seen)
        where = "misbehave" if kind == "exception" else "forward_pass"  # the raise; the last beat's frame
        assert seen["op"].startswith(where) and f"rank {victim} " in seen["message"], (rank, seen)
        assert seen["after_s"] < LIMIT_S, (rank, seen)
        if kind == "exception":
            assert "raised ValueError: the victim raised on purpose" in seen["message"], seen
        else:  # seen stopped in /proc after two missed beats, not after the 5 s timeout
            assert "is stopped (SIGSTOP) and sent no heartbeat for" in seen["message"], seen
            assert seen["after_s"] < STOPPED_LIMIT_S, (rank, seen)


def watch_with_own_sigint_handler(victim: int, folder: str) -> None:
    """``watch`` in a program that handles SIGINT itself (e.g. to save on Ctrl-C); the number of
    calls of its handler in ``sigint<rank>.json``."""
    import torch.distributed as dist
    calls = []
    signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    watch("exception", victim, folder)
    Path(folder, f"sigint{dist.get_rank()}.json").write_text(json.dumps(len(calls)))


def test_a_program_with_its_own_sigint_handler_still_gets_peer_failure_and_its_handler_is_not_called(
        tmp_path: Path) -> None:
    with pytest.raises(RankFailure) as failed:
        run(2, watch_with_own_sigint_handler, 1, str(tmp_path), timeout=90)
    assert failed.value.rank == 1, str(failed.value)
    seen = json.loads((tmp_path / "rank0.json").read_text())
    assert seen["raised"] == "PeerFailure" and seen["rank"] == 1, seen
    assert json.loads((tmp_path / "sigint0.json").read_text()) == 0


def test_process_state_tells_a_stopped_process_and_a_gone_one() -> None:
    from parts.comm.heartbeat_report import node_id, process_state
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_state(child.pid) in ("R", "S", "D")  # running, sleeping, or waiting on its disk
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(child.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(child.pid) == "T"
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) == "gone"
    assert node_id() and node_id() == node_id()


def slow_step(seconds: float) -> dict:
    import torch
    import torch.distributed as dist
    from parts.comm import Heartbeat
    with Heartbeat(exit_after=None) as beat:
        if dist.get_rank() == 1:
            torch.manual_seed(0)
            end = time.monotonic() + seconds
            while time.monotonic() < end:  # compute, holding the GIL between torch ops
                torch.randn(300, 300) @ torch.randn(300, 300)
        total = torch.ones(1)
        dist.all_reduce(total)  # the other ranks wait here, in gloo, for the whole slow step
    return {"failure": beat.failure, "total": total.item(), "cpu_s": beat.thread_cpu_s}


@pytest.mark.slow
def test_a_step_longer_than_the_timeout_is_not_a_failure() -> None:
    for rank, got in enumerate(run(2, slow_step, 6.5, timeout=90)):
        assert got["failure"] is None and got["total"] == 2.0, (rank, got)
        assert got["cpu_s"] < 0.01 * 6.5 + 0.1, (rank, got)  # the thread's CPU time: well under 1%


JOB = ROOT / "tests" / "heartbeat_job.py"


def _lines(process: subprocess.Popen) -> list[tuple[float, str]]:
    """Every output line of ``process`` with the time it arrived (its output closed after)."""
    with process.stdout:
        return [(time.time(), line) for line in process.stdout]


def _misbehaved_at(lines: list[tuple[float, str]]) -> float:
    return next(float(line.split(" at ")[1]) for _, line in lines if line.startswith("rank 1 misbehaves at"))


@pytest.mark.slow
def test_a_killed_rank_is_named_by_every_other_rank_within_10_s_when_no_agent_sees_it(tmp_path: Path) -> None:
    """Three workers started by hand around a store this test hosts (a rank on another node:
    no local agent sees it die). Gloo's "Connection closed by peer" names nobody; the
    heartbeat turns it into PeerFailure naming rank 1, its step and where it was."""
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port), "WORLD_SIZE": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    workers = [subprocess.Popen([sys.executable, str(JOB), "sigkill"], env={**base, "RANK": str(r),
                                "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for r in range(3)]
    lines = [_lines(w) for w in workers]
    codes = [w.wait(timeout=240) for w in workers]
    assert codes[1] == -signal.SIGKILL and codes[0] != 0 and codes[2] != 0, (codes, lines)
    killed = _misbehaved_at(lines[1])
    for rank in (0, 2):
        report = next(json.loads(line.split("PEER FAILURE ")[1]) for _, line in lines[rank] if "PEER FAILURE" in line)
        assert (report["failed"], report["step"]) == (1, 20) and report["op"].startswith("misbehave"), report
        assert report["time"] - killed < LIMIT_S, (report, killed)


@pytest.mark.slow
@pytest.mark.parametrize("end_stopped", [True, False])
def test_under_torchrun_a_stopped_rank_is_named_within_10_s_and_the_job_ends_non_zero(tmp_path: Path,
                                                                                     end_stopped: bool) -> None:
    """The others wait in an all-reduce that gloo cannot abort (plain torch waits there for the
    process group's 30-minute timeout). With ``end_stopped`` (the default) the heartbeat that
    names the stopped rank ends it, the all-reduce fails and every rank raises; without, they
    print the failure and exit 1 (the first to exit may end the job: the agent then stops the
    others), and the agent ends the job."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
               str(JOB), "sigstop", "end" if end_stopped else "keep"]
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = _lines(job)
    assert job.wait(timeout=240) != 0, lines[-40:]
    stopped = _misbehaved_at(lines)
    for rank in (0, 2):
        said = f"parts.comm.Heartbeat on rank {rank}: rank 1 (pid"
        seen, named = next(((t, line[line.index(said):]) for t, line in lines if said in line), (None, lines[-40:]))
        assert seen is not None and seen - stopped < LIMIT_S, (rank, named)
        assert "sent no heartbeat for" in named and "its last report: step 20, in misbehave" in named, named
        assert "is stopped (SIGSTOP)" in named and seen - stopped < STOPPED_LIMIT_S, (named, seen - stopped)
    if end_stopped:  # the all-reduce failed once rank 1 ended: a rank raised PeerFailure naming it; the
        # agent may end the other once the first exits, before it reports
        reports = [json.loads(line.split("PEER FAILURE ")[1]) for _, line in lines if "PEER FAILURE" in line]
        assert reports and all(r["failed"] == 1 and r["rank"] in (0, 2) for r in reports), lines[-40:]
        assert len(reports) == 2 or any("closing signal SIGTERM" in line for _, line in lines), lines[-40:]
    else:
        assert any("still running" in line and "exiting with 1" in line for _, line in lines), lines[-40:]
