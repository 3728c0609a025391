"""Each recipe, run the way its docstring says (``torchrun --standalone --nproc-per-node 2``) with
tiny settings, checked on what it prints and writes.

This is the one test file that launches processes itself: torchrun is the thing under test.
Every launch must exit 0 with a clean stderr. One launch per recipe is enough for an abort at
teardown, which shows on some launches only: ``test_reliability_exit.py`` checks its cause on
every run (no gloo thread outlives ``destroy_process_group``), and ``train_gpt.py`` alone is
launched seven times here. All selected launches start together (one module fixture) and each
test waits for its own, so the file costs the CPU time of its processes rather than the sum
of their wall times (torch's import and the first optimizer step cost ~3 s of CPU per process,
most of what a tiny recipe costs). To add a recipe: one more ``Case`` in ``CASES`` with its
tiny flags and a check function ``(stdout, workdir) -> None``.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
TIMEOUT = 240.0  # seconds per recipe from launch; all run at once on a loaded 2-core machine
CLEAN_STDERR = r"Traceback|terminate called|\w+Warning: (?!Failed to initialize NumPy)"


pytestmark = pytest.mark.slow  # every test here launches torchrun: run with -m slow (CI does)


@dataclass(frozen=True)
class Case:
    """One recipe run: script, flags (``{workdir}`` is replaced by a fresh directory), check."""

    name: str
    script: str
    args: tuple[str, ...]
    check: Callable[[str, Path], None]
    nproc: int = 2
    no_numpy: bool = False  # run with numpy unimportable (tests/no_numpy_run.py), as in a fresh venv
    launches: int = 1  # all at once; every one must exit 0


# ------------------------------------------------------------------ checks
def rows(pattern: str, text: str) -> list[tuple[str, ...]]:
    """Every line of ``text`` matching ``pattern`` (anchored at line start), as groups."""
    return [m.groups() for m in re.finditer(pattern, text, flags=re.MULTILINE)]


def check_memory_probe(out: str, workdir: Path) -> None:
    numel = 6 * (256 * 256 + 256)  # --nlayers 6 --hidden-dim 256
    assert f"Ψ = {numel:,} parameters" in out
    table = rows(r"^(partitioned|replicated)\s+(pre-init|post-init|after 1 forwards)"
                 r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+) \(", out)
    assert len(table) == 6, out  # 2 models x 3 phases, printed once (rank 0 only)
    for mode, phase, formula, *per_rank in table:
        rank0, rank1, rss0 = map(float, per_rank)
        # independent of the recipe's formula column: fp32 = 4 bytes; padding < 2 elements per param
        want = 0.0 if phase == "pre-init" else 4 * numel / (2 if mode == "partitioned" else 1) / 2**20
        assert abs(rank0 - want) <= 0.01 and abs(rank1 - want) <= 0.01, (mode, phase, rank0, rank1, want)
        assert abs(float(formula) - want) <= 0.01 and rss0 > 0
    assert len(rows(r"^\[rank 0\] (partitioned|replicated): ", out)) == 6
    assert "[rank 1]" not in out


def check_zero1_bf16(out: str, workdir: Path) -> None:
    losses = [float(v) for _, v in rows(r"^step\s+(\d+)\s+loss ([\d.naif]+)", out)]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses), out
    assert losses[-1] < losses[0] - 0.3, losses  # deterministic seeds: 4.75 -> about 3.7
    assert "replicas bitwise identical after 6 steps: True" in out
    numel = int(rows(r"^GPT of ([\d,]+) bf16 parameters", out)[0][0].replace(",", ""))
    want = {"bf16 params": 2 * numel, "fp32 grad accumulation buffer": 4 * numel,
            "fp32 grad partition": 4 * numel / 2, "fp32 master partition": 4 * numel / 2,
            "AdamW m + v": 8 * numel / 2}
    want["total"] = sum(want.values())
    for key, expected in want.items():
        (_, r0, r1), = rows(rf"^({re.escape(key)}.*?)\s+[\d,]+\s+([\d,]+)\s+([\d,]+)$", out)
        for got in (int(r0.replace(",", "")), int(r1.replace(",", ""))):
            # partitions are padded to 32-element multiples; Adam adds a 4-byte step per chunk
            assert expected <= got <= expected * 1.01 + 1024, (key, got, expected)


def check_checkpoint_only(out: str, workdir: Path) -> None:
    table = {name.strip(): (int(saved.replace(",", "")), same) for name, saved, same in
             rows(r"^((?:no checkpointing|checkpoint)[\w +]*?)\s+([\d,]+)\s+[\d.]+%\s+[\d.]+\s+(\w+)$", out)}
    assert len(table) == 4 and out.count("grads == plain") == 1, out  # one table, rank 0 only
    plain = table["no checkpointing"][0]
    kept = table["checkpoint"][0]
    split = table["checkpoint + partitioned"][0]
    assert kept < plain / 4 and split < kept, table
    assert table["checkpoint + partitioned + cpu_offload"][0] == split  # CPU only: nothing moves
    assert all(same == "True" for _, same in table.values()), table  # grads bitwise equal


def check_finetune(out: str, workdir: Path) -> None:
    (before, after), = rows(r"^validation loss ([\d.]+) -> ([\d.]+) after 4 steps", out)
    assert float(after) < float(before), out
    assert out.count("equal: True") == 2, out  # load and save both exact against a plain GPT
    sys.path.insert(0, str(RECIPES))
    try:
        from gpt_model import GPT, GPTConfig
    finally:
        sys.path.remove(str(RECIPES))
    state = torch.load(workdir / "tuned.pt", weights_only=True)
    plain = GPT(GPTConfig(block_size=32, n_layer=2, n_embd=64))
    plain.load_state_dict(state)  # strict: a plain PyTorch user can load what the recipe wrote
    start = torch.load(workdir / "pretrained.pt", weights_only=True)
    assert state.keys() == start.keys()
    assert not torch.equal(state["blocks.0.fc.weight"], start["blocks.0.fc.weight"])  # it trained


def _plain_gpt(**config):
    sys.path.insert(0, str(RECIPES))
    try:
        from gpt_model import GPT, GPTConfig
    finally:
        sys.path.remove(str(RECIPES))
    return GPT(GPTConfig(**config))


def read_checkpoint(directory: Path) -> dict:
    """A train_gpt DCP checkpoint directory as one dict (dcp_to_torch_save, as the README says)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    single = directory.parent / f"{directory.name}.pt"
    dcp_to_torch_save(directory, single)
    return torch.load(single, weights_only=True)


def check_train_gpt(out: str, workdir: Path) -> None:
    (first, last), = rows(r"^train loss\s+([\d.]+) -> ([\d.]+)", out)
    assert float(last) < float(first), out
    (gathered,), = rows(r"^all-gathered per step\s+([\d.]+) MiB", out)
    assert float(gathered) > 0, out  # the coordinator moved weights (fetched per block: threshold 1000)
    (fetches,), = rows(r"^prefetch hits / fetches\s+\d+ / (\d+)", out)
    assert int(fetches) > 0, out
    assert "--- sample ---" in out and out.count("validation loss") >= 2
    state = read_checkpoint(workdir / "gpt.ckpt")
    assert (state["world_size"], state["step"]) == (2, 6)
    _plain_gpt(block_size=32, n_layer=2, n_embd=64).load_state_dict(state["model"])  # strict


TRAIN_GPT_TINY = ("--steps", "6", "--n-layer", "2", "--n-embd", "64", "--seq-len", "32",
                  "--batch-size", "4", "--eval-interval", "3", "--eval-batches", "1", "--checkpoint",
                  "--persistence-threshold", "1000",
                  "--sample-chars", "16", "--dtype", "fp32", "--out", "{workdir}/gpt.ckpt",
                  "--plot", "{workdir}/loss.png")


def check_train_offload(out: str, workdir: Path) -> None:
    losses = [float(v) for (v,) in rows(r"^\[[#.]+\] \d+/3 loss ([\d.]+)", out)]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses), out
    (before, after), = rows(r"^step 1's batch: loss before -> after training\s+([\d.]+) -> ([\d.]+)", out)
    assert float(before) == losses[0] and float(after) < float(before), out  # it learned
    assert "parts.offload (on disk)" in out and "store per rank" in out
    assert f"scratch stores (removed at exit): {workdir}/store/rank0/parts-store-" in out, out
    leftovers = [p for p in (workdir / "store").rglob("*") if p.is_file()]
    assert leftovers == [], leftovers  # the scratch files are gone at exit


def check_train_gpt_2d(out: str, workdir: Path) -> None:
    assert "grid: 2 dp x 2 tp" in out, out
    losses = [float(v) for (v,) in rows(r"^step\s+\d+\s+loss ([\d.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0], out


def check_generate(out: str, workdir: Path) -> None:
    ways = rows(r"^(per-step gathers|generating \(gathered once\)|generating \(streamed, budget \d+ KiB\))"
                r"\s+([\d.]+) tokens/s  equal to unsharded: (True|False)", out)
    assert [w[0].split(" (")[0] for w in ways] == ["per-step gathers", "generating", "generating"], out
    assert all(w[2] == "True" for w in ways), out
    assert "from_pretrained equal: True" in out and (workdir / "hf" / "model.safetensors").is_file(), out


# every recipe but train_gpt (its default --device auto is the CPU here) runs with --device cpu
CASES = [
    Case("train_gpt_2d", "train_gpt_2d.py",
         ("--steps", "3", "--n-layer", "2", "--n-embd", "32", "--seq-len", "16", "--fp32", "--device", "cpu"),
         check_train_gpt_2d, nproc=4),
    # launched again by the two-machine and the resume tests
    Case("train_gpt", "train_gpt.py", TRAIN_GPT_TINY, check_train_gpt, no_numpy=True),
    Case("memory_probe", "memory_probe.py",
         ("--nlayers", "6", "--hidden-dim", "256", "--dtype", "fp32", "--forwards", "1", "--device", "cpu"),
         check_memory_probe),
    Case("zero1_bf16", "zero1_bf16.py", ("--steps", "6", "--device", "cpu"), check_zero1_bf16),
    # shards and AdamW state on disk, the optimizer stepping during backward
    Case("train_offload", "train_offload.py",
         ("--params", "25M", "--steps", "3", "--lr", "1e-4", "--store", "{workdir}/store", "--device", "cpu"),
         check_train_offload),
    Case("checkpoint_only", "checkpoint_only.py",
         ("--layers", "3", "--n-embd", "64", "--seq-len", "32", "--batch-size", "2", "--device", "cpu"),
         check_checkpoint_only),
    Case("finetune_from_state_dict", "finetune_from_state_dict.py",
         ("--steps", "4", "--n-layer", "2", "--n-embd", "64", "--seq-len", "32",
          "--out", "{workdir}/tuned.pt", "--device", "cpu"), check_finetune),
    Case("generate", "generate.py", ("--steps", "2", "--tokens", "6", "--n-embd", "32", "--n-layer", "2",
                                     "--seq-len", "16", "--export", "{workdir}/hf", "--device", "cpu"),
         check_generate),
]


# ------------------------------------------------------------------ running
@dataclass
class Launched:
    """A recipe started under torchrun in its own session, output going to files."""

    proc: subprocess.Popen
    workdir: Path
    started: float

    def finish(self) -> str:
        """Wait (within TIMEOUT of the launch) and return stdout; fail with stderr otherwise."""
        try:
            self.proc.wait(timeout=max(1.0, TIMEOUT - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"timed out after {TIMEOUT:.0f} s:\n{self.tail()}")
        if self.proc.returncode != 0:
            pytest.fail(f"exit code {self.proc.returncode}:\n{self.tail()}")
        return (self.workdir / "stdout").read_text()

    def tail(self) -> str:
        return "\n".join((self.workdir / name).read_text()[-4000:] for name in ("stdout", "stderr"))

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # torchrun and its two ranks, nothing else
            self.proc.wait()


def recipe_env() -> dict[str, str]:
    """The environment of a launched recipe: this checkout's ``parts`` first, unbuffered output."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}


def launch(case: Case, workdir: Path, nproc: int | None = None, rendezvous: tuple[str, ...] = (),
           shared: Path | None = None) -> Launched:
    """Start ``torchrun --standalone --nproc-per-node <nproc> recipes/<script> <args>``.

    With ``rendezvous`` (torchrun's multi-machine flags) instead of ``--standalone``; output
    goes to ``workdir``, files the recipe writes to ``shared`` (default: ``workdir``).
    """
    args = [a.replace("{workdir}", str(shared or workdir)) for a in case.args]
    placement = rendezvous or ("--standalone", "--nproc-per-node", str(nproc or case.nproc))
    script = [str(ROOT / "tests" / "no_numpy_run.py")] if case.no_numpy else []
    command = [sys.executable, "-m", "torch.distributed.run", *placement, *script, str(RECIPES / case.script), *args]
    with open(workdir / "stdout", "w") as out, open(workdir / "stderr", "w") as err:
        proc = subprocess.Popen(command, cwd=workdir, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=recipe_env())
    return Launched(proc, workdir, time.monotonic())


def selected_launch(item: pytest.Item) -> tuple[Case, int] | None:
    """The ``(Case, launch index)`` a collected test of this module runs, if any."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or getattr(item, "module", None) is not sys.modules[__name__]:
        return None
    case = callspec.params.get("case")
    return None if case is None else (case, callspec.params.get("attempt", 0))


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_two_machines(case: Case, shared: Path) -> list[Launched]:
    """``case`` as two one-process launchers meeting through a c10d rendezvous: two "machines"."""
    flags = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "two-machines")
    nodes = [shared / f"node{index}" for index in range(2)]
    for node in nodes:
        node.mkdir()
    return [launch(case, node, rendezvous=flags, shared=shared) for node in nodes]


HYBRID_TINY = ("--steps", "4", "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "16",
               "--batch-size", "2", "--eval-interval", "4", "--eval-batches", "2", "--sample-chars", "0",
               "--persistence-threshold", "0", "--dtype", "fp32", "--data", "{workdir}/text.txt",
               "--out", "{workdir}/gpt.ckpt", "--plot", "{workdir}/loss.png")
HYBRID = Case("train_gpt_hybrid", "train_gpt.py", (*HYBRID_TINY, "--hybrid"), lambda out, workdir: None)
FULL_4 = Case("train_gpt_full_4", "train_gpt.py", HYBRID_TINY, lambda out, workdir: None, nproc=4)  # checked
# against each other by test_train_gpt_hybrid_on_two_machines_equals_full_sharding


def launch_hybrid_pair(directory: Path) -> dict[tuple[str, int], Launched]:
    """train_gpt --hybrid on two launchers of 2 ranks each (static rendezvous on localhost, so
    LOCAL_WORLD_SIZE=2 makes a 2 x 2 mesh), and the same flags fully sharded at --nproc-per-node 4.
    The text is the recipes' own sources (small: each rank reads it in milliseconds)."""
    shared, full = directory / "hybrid", directory / "full"
    text = "".join(path.read_text() for path in sorted(RECIPES.glob("*.py")))
    runs = {}
    for workdir in (shared, full):
        workdir.mkdir()
        (workdir / "text.txt").write_text(text)
    port = free_port()
    for index in range(2):
        (shared / f"node{index}").mkdir()
        flags = ("--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(index), "--rdzv-backend", "static",
                 "--master-addr", "127.0.0.1", "--master-port", str(port))
        runs[HYBRID.name, index] = launch(HYBRID, shared / f"node{index}", rendezvous=flags, shared=shared)
    runs[FULL_4.name, 0] = launch(FULL_4, full)
    return runs


def hybrid_selected(session: pytest.Session) -> bool:
    """Whether the hybrid-against-full-sharding test runs in this session."""
    return any(item.name == "test_train_gpt_hybrid_on_two_machines_equals_full_sharding" for item in session.items)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """Every selected launch ``(recipe name, index)``, all started at once (train_gpt also on
    two "machines": ``("train_gpt_node", 0)`` and ``("train_gpt_node", 1)``)."""
    selected = {(case.name, index)
                for case, index in filter(None, map(selected_launch, request.session.items))}
    runs = {(c.name, i): launch(c, tmp_path_factory.mktemp(f"{c.name}_{i}"))
            for c in CASES for i in range(c.launches) if (c.name, i) in selected}
    if ("train_gpt", 0) in selected:
        train_gpt = next(c for c in CASES if c.name == "train_gpt")
        for index, node in enumerate(launch_two_machines(train_gpt, tmp_path_factory.mktemp("machines"))):
            runs["train_gpt_node", index] = node
    if hybrid_selected(request.session):
        runs.update(launch_hybrid_pair(tmp_path_factory.mktemp("hybrid_pair")))
    yield runs
    for run in runs.values():
        run.kill()


def test_train_gpt_resumes_at_another_world_size(launched, tmp_path) -> None:
    """The world-2 DCP checkpoint of the train_gpt case continues at world 3 from step 6 (numpy
    unimportable in both runs, as in a fresh venv: DCP's plans go through parts.comm).

    The file's first test: this run starts as soon as the train_gpt case ends, while the other
    launches still run, rather than alone after all of them."""
    first = launched.get(("train_gpt", 0))
    if first is None:
        pytest.skip("the train_gpt case was not selected")
    first.finish()
    shutil.copytree(first.workdir / "gpt.ckpt", tmp_path / "gpt.ckpt")
    resume = Case("train_gpt_resume", "train_gpt.py",
                  ("--resume", *TRAIN_GPT_TINY[:1], "2", *TRAIN_GPT_TINY[2:]), check_train_gpt, no_numpy=True)
    out = launch(resume, tmp_path, nproc=3).finish()
    assert "steps 7..8" in out, out
    stderr = (tmp_path / "stderr").read_text()
    assert not re.search(CLEAN_STDERR, stderr), stderr
    before, after = read_checkpoint(first.workdir / "gpt.ckpt"), read_checkpoint(tmp_path / "gpt.ckpt")
    assert (after["world_size"], after["step"]) == (3, 8)
    assert after["optimizer"]["state"].keys() == before["optimizer"]["state"].keys()
    assert not torch.equal(after["model"]["blocks.0.fc.weight"], before["model"]["blocks.0.fc.weight"])


@pytest.mark.parametrize(("case", "attempt"), [pytest.param(c, i, id=f"{c.name}-launch{i + 1}")
                                               for c in CASES for i in range(c.launches)])
def test_recipe(case: Case, attempt: int, launched) -> None:
    """Exit 0 (no SIGABRT at teardown), no traceback or warning, and the output checks, on every launch."""
    run = launched[case.name, attempt]
    out = run.finish()
    stderr = (run.workdir / "stderr").read_text()
    # clean run, no Python warnings (but torch's own note, at import, that numpy is absent)
    assert not re.search(CLEAN_STDERR, stderr), stderr
    case.check(out, run.workdir)


def summary_rows(out: str) -> dict[str, str]:
    """The summary table's loss rows of a train_gpt run."""
    return dict(rows(r"^((?:train|validation) loss)\s+(.+)$", out))


def test_train_gpt_on_two_machines_equals_one(launched) -> None:
    """torchrun --nnodes 2 (two launchers, c10d rendezvous) trains exactly as --standalone does."""
    if ("train_gpt", 0) not in launched:
        pytest.skip("the train_gpt case was not selected")
    single = launched["train_gpt", 0]
    single_out = single.finish()
    nodes = [launched["train_gpt_node", i] for i in range(2)]
    nodes_out = "".join(node.finish() for node in nodes)
    for node in nodes:
        stderr = (node.workdir / "stderr").read_text()
        assert not re.search(CLEAN_STDERR, stderr), stderr
    assert summary_rows(nodes_out) == summary_rows(single_out) and summary_rows(single_out), nodes_out
    shared = launched["train_gpt_node", 0].workdir.parent
    check_train_gpt(nodes_out, shared)
    ours, theirs = read_checkpoint(shared / "gpt.ckpt"), read_checkpoint(single.workdir / "gpt.ckpt")
    assert ours["model"].keys() == theirs["model"].keys()
    assert all(torch.equal(ours["model"][k], theirs["model"][k]) for k in ours["model"])
    assert ours["step"] == theirs["step"] == 6


def validation_loss(directory: Path, args: tuple[str, ...]) -> float:
    """The recipe's validation loss (its own ``evaluate``) of the weights in the checkpoint
    ``directory``, computed here by a plain GPT, to every digit (the recipe prints four)."""
    import argparse
    sys.path.insert(0, str(RECIPES))
    try:
        from chardata import VOCAB_SIZE, load_splits
        from gpt_model import GPT, GPTConfig
        from train_gpt import evaluate
    finally:
        sys.path.remove(str(RECIPES))
    flag = dict(zip(args[::2], args[1::2]))
    n = {k: int(flag[f"--{k.replace('_', '-')}"]) for k in ("n_layer", "n_head", "n_embd", "seq_len", "batch_size",
                                                             "eval_batches")}
    model = GPT(GPTConfig(vocab_size=VOCAB_SIZE, block_size=n["seq_len"], n_layer=n["n_layer"],
                          n_head=n["n_head"], n_embd=n["n_embd"]))
    model.load_state_dict(read_checkpoint(directory / "gpt.ckpt")["model"])
    _, val = load_splits(str(directory / "text.txt"))
    return evaluate(model, val, argparse.Namespace(**n))


def _without_exit_barrier_report(stderr: str) -> str:
    """``stderr`` without the lines torchrun's agent logs when the peer launcher hosting the store
    left the exit barrier first (every worker had finished; a race between two launchers, which
    the workers' own output never contains)."""
    if "Error waiting on exit barrier" not in stderr:
        return stderr
    return "\n".join(line for line in stderr.splitlines() if "elastic/agent/server/api.py" not in line)


HYBRID_RTOL = 1e-5  # the grad mean runs over 2 ranks then across 2 replicas instead of over 4: sums reordered


def test_train_gpt_hybrid_on_two_machines_equals_full_sharding(launched) -> None:
    """train_gpt --hybrid on 2 launchers x 2 ranks (a 2 x 2 mesh) ends at full sharding's validation loss."""
    runs = [launched[HYBRID.name, 0], launched[HYBRID.name, 1], launched[FULL_4.name, 0]]
    try:
        outs = [run.finish() for run in runs]
    finally:
        for run in runs:  # a launcher left waiting for its peer would wait until killed
            run.kill()
    for run in runs:
        stderr = _without_exit_barrier_report((run.workdir / "stderr").read_text())
        assert not re.search(CLEAN_STDERR, stderr), stderr
    hybrid_out, full_out = outs[0] + outs[1], outs[2]
    assert "world 4" in hybrid_out and "world 4" in full_out
    shared, full = runs[0].workdir.parent, runs[2].workdir
    ours, theirs = validation_loss(shared, HYBRID_TINY), validation_loss(full, HYBRID_TINY)
    assert abs(ours - theirs) <= HYBRID_RTOL * theirs, (ours, theirs)
    for out, loss in ((hybrid_out, ours), (full_out, theirs)):  # the runs' own last evaluation
        (printed,), = rows(r"^validation loss\s+[\d.]+ -> ([\d.]+)", out)
        assert abs(float(printed) - loss) <= 5.1e-5, (printed, loss)
    state = read_checkpoint(shared / "gpt.ckpt")
    assert (state["world_size"], state["step"]) == (4, 4)


def test_device_flag_picks_the_cpu_without_cuda(monkeypatch) -> None:
    """--device auto is the CPU where torch sees no GPU; --device cuda there says why it cannot run."""
    monkeypatch.syspath_prepend(str(RECIPES))
    import devices
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.pick("auto") == devices.pick("cpu") == torch.device("cpu")
    with pytest.raises(SystemExit, match="--device cuda: this torch sees no CUDA device"):
        devices.pick("cuda")


REPRODUCIBLE_TINY = ("--steps", "3", "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "16",
                     "--batch-size", "2", "--eval-interval", "3", "--eval-batches", "1", "--sample-chars", "0",
                     "--dtype", "fp32", "--reproducible", "6", "--out", "{workdir}/gpt.ckpt",
                     "--plot", "{workdir}/loss.png", "--device", "cpu")


def _same_bits(a: object, b: object, where: str = "") -> None:
    """``a`` and ``b`` (nested checkpoint dicts) equal, tensors with ``torch.equal``."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            if k != "world_size":
                _same_bits(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_train_gpt_reproducible_checkpoints_are_the_same_bits_at_1_2_and_3_processes(tmp_path) -> None:
    """--reproducible 6 at 1, 2 and 3 processes writes checkpoints equal bitwise, weights and
    optimizer state; resumed at 3 from the 2-process one equals resumed at 2 from the 1-process one."""
    case = Case("train_gpt_reproducible", "train_gpt.py", REPRODUCIBLE_TINY, lambda out, workdir: None)
    dirs = {n: tmp_path / f"world{n}" for n in (1, 2, 3)}
    for d in dirs.values():
        d.mkdir()
    runs = [launch(case, d, nproc=n) for n, d in dirs.items()]
    try:
        for run in runs:
            run.finish()
    finally:
        for run in runs:
            run.kill()
    states = {n: read_checkpoint(d / "gpt.ckpt") for n, d in dirs.items()}
    assert [states[n]["world_size"] for n in dirs] == [1, 2, 3]
    for n in (2, 3):
        _same_bits(states[1], states[n])
    resumed = {}
    for before, after in ((2, 3), (1, 2)):
        where = tmp_path / f"resume{before}to{after}"
        where.mkdir()
        shutil.copytree(dirs[before] / "gpt.ckpt", where / "gpt.ckpt")
        out = launch(Case("resume", "train_gpt.py", (*REPRODUCIBLE_TINY, "--resume"), case.check), where,
                     nproc=after).finish()
        assert "steps 4..6" in out, out
        resumed[after] = read_checkpoint(where / "gpt.ckpt")
    _same_bits(resumed[3], resumed[2])
    assert not torch.equal(resumed[3]["model"]["wte.weight"], states[1]["model"]["wte.weight"])  # it trained on
