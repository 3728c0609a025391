"""The one-GPU check of parts: every stage in its own process under a timeout, results as JSON.

    bash benchmarks/gpu_check.sh                           # on a machine with one CUDA GPU
    python benchmarks/gpu_check.py --mode cpu --out DIR    # the same stages on the CPU, tiny sizes

CUDA mode is the default. Where this process sees no usable CUDA GPU, the check stops at once with
exit status 2 and names the cause (torch built without CUDA, CUDA's initialisation error, no device
visible): a broken GPU node fails. The CPU stand-in runs only when asked for, by ``--mode cpu`` or
``PARTS_GPU_CHECK_CPU=1``.

Stages, in order (docs/gpu.md says what each shows): ``env``; ``w1`` (world-1 NCCL: sharded
equals plain bitwise, MixedPrecision against FSDP2, checkpoint RNG replay, DCP resume, host
syncs per phase); ``offload`` (shards and optimizer state on disk or in pinned host memory,
compute on the GPU); ``audit`` (the placement audit on device tensors); ``pair`` (two gloo ranks
on the one GPU over the NCCL code path); ``perf_plain``, ``perf_parts``, ``perf_fsdp2`` (one step
of a ~1B GPT each); ``beyond`` (model states larger than the GPU memory allowed). A stage that
runs past its timeout, or past the budget left, is killed with its process group and fails;
nothing waits longer than ``--budget`` seconds in all. ``--out`` receives ``gpu_check.json``
(every check), ``gpu_check.jsonl`` (one ``record.py`` row, for ``render_results.py``) and
``gpu_check.log`` (every stage's output). The exit status is 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
# name: (processes, seconds at most on a GPU)
STAGES = {"env": (1, 60), "w1": (1, 120), "offload": (1, 90), "audit": (1, 60), "pair": (2, 90),
          "perf_plain": (1, 75), "perf_parts": (1, 90), "perf_fsdp2": (1, 75), "beyond": (1, 120)}
TEST_STAGES = {"hang": (1, 2)}  # never returns: shows a stage cannot outlive its timeout (not scaled)


def run_stage(name: str, mode: str, work: Path) -> None:
    """Run stage ``name`` in this process; rank 0 writes ``work/<name>.json``."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    import gpu_audit
    import gpu_checks
    import gpu_runs
    ctx = gpu_checks.Context(mode, scratch=tempfile.mkdtemp(prefix=f"{name}_", dir=work))
    if name == "env":
        ctx.record("env", "INFO", json.dumps(environment(mode)))
    elif name == "hang":
        time.sleep(3600)
    elif name == "pair":
        if mode == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("gloo")  # torchrun's environment; both ranks on the one device
        gpu_runs.stage_pair(ctx)
    else:
        stage = {"w1": gpu_checks.stage_w1, "offload": gpu_checks.stage_offload, "audit": gpu_audit.stage_audit,
                 "beyond": gpu_runs.stage_beyond, "perf_plain": lambda c: gpu_runs.stage_perf(c, "plain"),
                 "perf_parts": lambda c: gpu_runs.stage_perf(c, "parts"),
                 "perf_fsdp2": lambda c: gpu_runs.stage_perf(c, "fsdp2")}[name]
        with ctx.guard(name):
            stage(ctx)
    if not dist.is_initialized() or dist.get_rank() == 0:
        (work / f"{name}.json").write_text(json.dumps(ctx.checks))
    if dist.is_initialized():
        dist.destroy_process_group()


def environment(mode: str) -> dict[str, Any]:
    """Versions and the device, as the report names them."""
    import torch

    import parts
    info: dict[str, Any] = {"mode": mode, "torch": torch.__version__, "parts": str(Path(parts.__file__).parent)}
    if mode == "cuda":
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                    nccl=".".join(map(str, version)) if isinstance(version := torch.cuda.nccl.version(), tuple)
                    else str(version))
    return info


def cuda_unusable() -> Optional[str]:
    """Why this process cannot compute on a CUDA GPU, or None where it can."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable by {sys.executable}: {exc}"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA (torch.version.cuda is None)"
    visible = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}"
    try:
        torch.cuda.init()
    except Exception as exc:  # noqa: BLE001 - its text is the cause
        return f"CUDA failed to initialise ({visible}): {type(exc).__name__}: {exc}"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return f"no CUDA device visible: torch.cuda.is_available() is False ({visible})"
    return None


def default_mode() -> str:
    """``cpu`` where ``PARTS_GPU_CHECK_CPU`` asks for the CPU stand-in, else ``cuda``."""
    return "cpu" if os.environ.get("PARTS_GPU_CHECK_CPU", "") not in ("", "0") else "cuda"


def device_name(mode: str) -> str:
    """The device the check ran on, as RESULTS.md names it."""
    if mode != "cuda":
        return "cpu"
    import torch
    return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"


def launch(name: str, mode: str, work: Path, timeout: float, log: Any) -> dict[str, Any]:
    """Run one stage in a new process group, killed at ``timeout``; its checks, or one FAIL."""
    procs = (STAGES | TEST_STAGES)[name][0]
    me = [str(Path(__file__).resolve()), "--stage", name, "--mode", mode, "--work", str(work)]
    cmd = [sys.executable, *(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)]
                             if procs > 1 else []), *me]
    log.write(f"\n===== stage {name} (timeout {timeout:.0f} s): {' '.join(cmd)}\n")
    log.flush()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        code = None
    seconds = round(time.perf_counter() - start, 1)
    result = work / f"{name}.json"
    checks = json.loads(result.read_text()) if result.exists() else []
    if code is None:
        checks.append({"check": name, "status": "FAIL", "detail": f"timed out after {timeout:.0f} s: killed"})
    elif not checks or code != 0:
        checks.append({"check": name, "status": "FAIL", "detail": f"exit status {code} (see gpu_check.log)"})
    status = "FAIL" if any(c["status"] == "FAIL" for c in checks) else \
        "PASS" if any(c["status"] == "PASS" for c in checks) else checks[0]["status"]
    return {"stage": name, "status": status, "seconds": seconds, "checks": checks}


def _kill(proc: subprocess.Popen) -> None:
    """End a stage's whole process group: SIGTERM, then SIGKILL 10 s later."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def check(mode: str, stages: list[str], out: Path, budget: float, scale: float) -> dict[str, Any]:
    """Run ``stages`` within ``budget`` seconds; the report written to ``out/gpu_check.json``."""
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    start, report = time.perf_counter(), []
    with open(out / "gpu_check.log", "w") as log:
        for name in stages:
            left = budget - (time.perf_counter() - start)
            limit = min(STAGES[name][1] * scale if name in STAGES else TEST_STAGES[name][1], left)
            if left < 10:
                report.append({"stage": name, "status": "SKIP", "seconds": 0.0,
                               "checks": [{"check": name, "status": "SKIP", "detail": "budget spent"}]})
                continue
            report.append(launch(name, mode, work, limit, log))
            print(f"{report[-1]['status']:<5} {name:<11} {report[-1]['seconds']:6.1f} s", flush=True)
    result = {"device": device_name(mode), "mode": mode, "seconds": round(time.perf_counter() - start, 1),
              "stages": report}
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    return result


def record_row(result: dict[str, Any], out: Path, command: str) -> Path:
    """Append the run to ``out/gpu_check.jsonl`` as ``record.py`` writes benchmark rows."""
    sys.path.insert(0, str(HERE))
    from record import record
    rows = [{"stage": s["stage"], "check": c["check"], "status": c["status"], "detail": c["detail"][:200]}
            for s in result["stages"] for c in s["checks"]]
    counts = {k: sum(r["status"] == k for r in rows) for k in ("PASS", "FAIL", "SKIP", "INFO")}
    summary = {"device": result["device"], "mode": result["mode"], "seconds": result["seconds"],
               **{k.lower(): v for k, v in counts.items()}}
    return record("gpu_check", {"rows": rows, "summary": summary}, command=command, directory=out)


def main() -> int:
    """Run the check (or, with ``--stage``, one stage in this process)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("cpu", "cuda"), default=default_mode(),
                    help="cuda (the default; fails where no GPU is usable) or cpu: the CPU stand-in at tiny "
                         "sizes (also PARTS_GPU_CHECK_CPU=1)")
    ap.add_argument("--out", type=Path, default=Path("gpu_check_out"), help="where the results go")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for all stages together")
    ap.add_argument("--only", default="", help="comma-separated stages (default: all)")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    mode = args.mode
    if args.stage:
        run_stage(args.stage, mode, args.work)
        return 0
    stages = [s for s in args.only.split(",") if s] or list(STAGES)
    unknown = [s for s in stages if s not in STAGES | TEST_STAGES]
    if unknown:
        raise SystemExit(f"gpu_check: unknown stage(s) {unknown}; stages: {', '.join(STAGES)}")
    if mode == "cuda" and (cause := cuda_unusable()) is not None:
        print(f"gpu_check: FAIL: no usable CUDA GPU: {cause}. For the CPU stand-in, pass --mode cpu "
              "or set PARTS_GPU_CHECK_CPU=1.", file=sys.stderr)
        return 2
    result = check(mode, stages, args.out, args.budget, 1.0 if mode == "cuda" else 3.0)
    record_row(result, args.out, "bash benchmarks/gpu_check.sh" if mode == "cuda" else
               f"python benchmarks/gpu_check.py --mode {mode}")
    failed = [c["check"] for s in result["stages"] for c in s["checks"] if c["status"] == "FAIL"]
    print(f"{result['device']}: {len(failed)} failed {failed} in {result['seconds']} s; results in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
