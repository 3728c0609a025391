"""The one-GPU check (benchmarks/gpu_check.py) in its CPU mode: every stage that applies on the CPU
passes, and the driver kills a stage that outlives its timeout and still writes its JSON. Without
a usable GPU and without the CPU asked for, the check fails at once, naming the cause."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from harness import run

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

EXPECTED_PASS = {"equivalence.per_module", "equivalence.default_knobs", "mixed_precision.vs_fsdp2",
                 "checkpoint_rng.dropout_replayed", "dcp_resume.bitwise", "offload.disk_after_backward",
                 "offload.disk_in_backward", "offload.host_memory", "beyond.states_exceed_device_memory"}


def body_world1_stages():
    import gpu_checks
    import gpu_runs
    ctx = gpu_checks.Context("cpu", tempfile.mkdtemp())
    for stage in (gpu_checks.stage_w1, gpu_checks.stage_offload, gpu_runs.stage_beyond,
                  lambda c: gpu_runs.stage_perf(c, "parts")):
        stage(ctx)
    return ctx.checks


def body_pair():
    import gpu_checks
    import gpu_runs
    ctx = gpu_checks.Context("cpu", tempfile.mkdtemp())
    gpu_runs.stage_pair(ctx)
    return ctx.checks


def test_cpu_mode_stages_pass():
    checks = {c["check"]: c for c in run(1, body_world1_stages, timeout=120)[0]}
    assert not [c for c in checks.values() if c["status"] == "FAIL"], checks
    assert all(checks[name]["status"] == "PASS" for name in EXPECTED_PASS), checks
    assert checks["sync_count"]["status"] == "SKIP" and checks["perf.parts"]["status"] == "INFO"


def test_audit_stage_runs_its_scenarios_or_says_it_is_not_available(tmp_path):
    import gpu_audit
    import gpu_checks
    ctx = gpu_checks.Context("cpu", str(tmp_path))
    gpu_audit.stage_audit(ctx)  # in this process: the audit makes its own fake world
    assert ctx.checks and not [c for c in ctx.checks if c["status"] == "FAIL"], ctx.checks
    assert all(c["status"] == "INFO" or "not available" in c["detail"] for c in ctx.checks), ctx.checks


def test_two_ranks_on_one_device_equal_one_process():
    for checks in run(2, body_pair, timeout=120):
        by_name = {c["check"]: c for c in checks}
        assert by_name["pair.gloo_path"]["status"] == "PASS", checks
        nccl = by_name["pair.nccl_path"]
        assert nccl["status"] == "PASS" or "not available" in nccl["detail"], checks


@pytest.mark.slow
def test_driver_kills_a_hung_stage_and_records_the_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(BENCH.parent))
    done = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--mode", "cpu", "--only", "env,hang",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr  # the hung stage failed
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    stages = {s["stage"]: s for s in result["stages"]}
    assert result["device"] == "cpu" and stages["env"]["status"] == "INFO"
    assert stages["hang"]["status"] == "FAIL" and "timed out after 2 s" in stages["hang"]["checks"][-1]["detail"]
    assert stages["hang"]["seconds"] < 30
    from render_results import latest_runs, render
    text = render(latest_runs(tmp_path))
    assert "## gpu_check" in text and "- device: cpu" in text and "timed out" in text


def _no_cpu_request() -> dict:
    env = dict(os.environ, PYTHONPATH=str(BENCH.parent), PYTHON=sys.executable)
    env.pop("PARTS_GPU_CHECK_CPU", None)
    return env


@pytest.mark.skipif(torch.cuda.is_available(), reason="a usable CUDA GPU: the check runs on it")
def test_shell_check_without_a_gpu_fails_at_once_naming_the_cause(tmp_path):
    done = subprocess.run(["bash", str(BENCH / "gpu_check.sh"), "--only", "env"], env=_no_cpu_request(),
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no usable CUDA GPU" in done.stderr and "--mode cpu" in done.stderr, done.stderr
    cause = "built without CUDA" if torch.version.cuda is None else "CUDA"
    assert cause in done.stderr, done.stderr
    assert not (tmp_path / "gpu_check_out").exists()  # no stage ran


def test_cpu_mode_is_asked_for_by_the_environment_and_cuda_is_the_default(monkeypatch):
    import gpu_check
    monkeypatch.delenv("PARTS_GPU_CHECK_CPU", raising=False)
    assert gpu_check.default_mode() == "cuda"
    monkeypatch.setenv("PARTS_GPU_CHECK_CPU", "0")
    assert gpu_check.default_mode() == "cuda"
    monkeypatch.setenv("PARTS_GPU_CHECK_CPU", "1")
    assert gpu_check.default_mode() == "cpu"


def test_cuda_init_error_text_is_the_named_cause(monkeypatch):
    import gpu_check

    def broken_init():
        raise RuntimeError("CUDA driver initialization failed, you might not have a CUDA gpu.")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "init", broken_init)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    cause = gpu_check.cuda_unusable()
    assert "CUDA driver initialization failed" in cause and "CUDA_VISIBLE_DEVICES=3" in cause, cause
