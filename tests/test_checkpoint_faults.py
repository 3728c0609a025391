"""Checkpoint faults are loud on every rank and never cost the last good checkpoint.

- A step that fails on one rank (a write, a damaged file it reads, an object that does not
  pickle) raises on every rank, naming the rank and the file, at world 1, 2 and 3 with the
  failure on each rank in turn.
- ``parts.comm.dcp.save`` commits a new checkpoint only once it is complete: a disk that
  fills during a save over an existing checkpoint (a real tmpfs of a few hundred KiB where
  ``mount`` works, else an ENOSPC raised by the write on rank 1) leaves the old checkpoint
  loadable bitwise, through ``parts.comm.dcp`` and through ``recipes/train_gpt.py``'s own
  save and resume.
- ``load`` refuses a missing, truncated or bit-flipped file, keys that differ from the state
  dict's (``strict=False`` opts out), and a ``.metadata`` whose pickle would run code.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from harness import run

SLOW = 120.0  # DCP's first import in a worker takes seconds on a loaded 2-core machine
RECIPES = str(Path(__file__).resolve().parents[1] / "recipes")
PAGE = 4096


# ------------------------------------------------------------------ worker helpers
def _model(final: str = "ln_f", width: int = 10) -> torch.nn.Module:
    """A small sharded model whose last norm is named ``final`` (same seed, same weights)."""
    from parts.partition import partitioned
    torch.manual_seed(3)
    with partitioned():
        return torch.nn.Sequential(OrderedDict([("fc", torch.nn.Linear(6, width)),
                                                (final, torch.nn.LayerNorm(width)),
                                                ("head", torch.nn.Linear(width, 4))]))


def _full(model: torch.nn.Module) -> dict:
    from parts.partition import full_state_dict
    return {k: v.clone() for k, v in full_state_dict(model, rank0_only=False).items()}


def _perturb(model: torch.nn.Module) -> None:
    from parts.partition import shards
    with torch.no_grad():
        for shard in shards(model):
            shard.add_(1.0)


def _outcome(fn) -> dict:
    """``{"ok": result}``, or what the ``CheckpointError`` it raised says (rank-independent fields)."""
    from parts.comm.dcp import CheckpointError
    try:
        return {"ok": fn()}
    except CheckpointError as error:
        return {"error": str(error), "ranks": error.ranks, "path": error.path}


@contextlib.contextmanager
def _writes_fail(on: bool):
    """DCP's item writes raise ENOSPC (naming their file) inside the block, where ``on``."""
    import torch.distributed.checkpoint.filesystem as fs
    real = fs._write_item

    def full(transforms, stream, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", getattr(stream, "name", "?"))
    fs._write_item = full if on else real
    try:
        yield
    finally:
        fs._write_item = real


def _save(model: torch.nn.Module, path: str) -> None:
    from parts.comm import dcp
    from parts.partition import sharded_state_dict
    dcp.save({"model": sharded_state_dict(model)}, checkpoint_id=path)


def _load(model: torch.nn.Module, path: str, strict: bool = True) -> None:
    from parts.comm import dcp
    from parts.partition import load_sharded_state_dict, sharded_state_dict
    state = {"model": sharded_state_dict(model)}
    dcp.load(state, checkpoint_id=path, **({} if strict else {"strict": False}))
    load_sharded_state_dict(model, state["model"])


def _assert_named_everywhere(outcomes: list[dict], rank: int, *names: str) -> None:
    """Every rank raised CheckpointError naming ``rank`` (alone) and each of ``names``."""
    for seen, outcome in enumerate(outcomes):
        assert "error" in outcome, f"rank {seen} returned normally: {outcome}"
        assert outcome["ranks"] == [rank], (seen, outcome["error"])
        assert f"rank {rank}:" in outcome["error"], outcome["error"]
        for name in names:
            assert name in outcome["error"], (name, outcome["error"])


# ------------------------------------------------------------------ agreement: world 1-3, each rank
def save_failing_on(path: str, bad: int) -> dict:
    import torch.distributed as dist
    model = _model()
    with _writes_fail(dist.get_rank() == bad):
        return _outcome(lambda: _save(model, path))


def load_truncated_on(path: str, bad: int) -> dict:
    import torch.distributed as dist
    model = _model()
    _save(model, path)
    dist.barrier()
    if dist.get_rank() == 0:
        victim = Path(path) / f"__{bad}_0.distcp"
        os.truncate(victim, victim.stat().st_size // 2)
    dist.barrier()
    return _outcome(lambda: _load(_model(), path))


def exchange_unpicklable_on(bad: int) -> str:
    import torch.distributed as dist

    from parts.comm import RankDisagreement, all_gather_objects
    try:
        all_gather_objects((lambda: None) if dist.get_rank() == bad else dist.get_rank())
    except RankDisagreement as error:
        return f"disagreement: {error}"
    except Exception as error:  # noqa: BLE001 - the failing rank keeps its own error
        return f"own: {type(error).__name__}"
    return "returned"


CASES = [(world, bad) for world in (1, 2, 3) for bad in range(world)]


@pytest.mark.parametrize("world,bad", CASES)
def test_a_save_failing_on_one_rank_raises_on_every_rank_naming_it(tmp_path: Path, world: int, bad: int) -> None:
    out = run(world, save_failing_on, str(tmp_path / "ckpt"), bad, timeout=SLOW)
    _assert_named_everywhere(out, bad, "No space left on device", f"__{bad}_0.distcp", str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ckpt.saving").exists()


@pytest.mark.parametrize("world,bad", CASES)
def test_a_file_truncated_for_one_rank_raises_on_every_rank_naming_it(tmp_path: Path, world: int, bad: int) -> None:
    out = run(world, load_truncated_on, str(tmp_path / "ckpt"), bad, timeout=SLOW)
    _assert_named_everywhere(out, bad, f"__{bad}_0.distcp", "truncated")


@pytest.mark.parametrize("world,bad", [c for c in CASES if c[0] > 1])
def test_an_object_that_does_not_pickle_on_one_rank_raises_on_every_rank(world: int, bad: int) -> None:
    out = run(world, exchange_unpicklable_on, bad, timeout=SLOW)
    for rank, said in enumerate(out):
        if rank == bad:
            assert said.startswith("own: "), said
        else:
            assert said.startswith("disagreement: ") and f"rank {bad}:" in said, said


# ------------------------------------------------------------------ damaged checkpoints
def load_damaged(path: str, damage: str) -> dict:
    import torch.distributed as dist
    model = _model()
    _save(model, path)
    saved = _full(model)
    dist.barrier()
    if dist.get_rank() == 0:
        victim = Path(path) / "__1_0.distcp"
        if damage == "missing":
            victim.unlink()
        elif damage == "truncated":
            os.truncate(victim, victim.stat().st_size - 1)
        else:  # one bit of a weight flipped, size unchanged: only a checksum sees it
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0x01
            victim.write_bytes(data)
    dist.barrier()
    fresh = _model()
    _perturb(fresh)
    outcome = _outcome(lambda: _load(fresh, path))
    outcome["unchanged"] = all(not torch.equal(v, saved[k]) for k, v in _full(fresh).items())
    return outcome


@pytest.mark.parametrize("damage,words", [("missing", "is missing"), ("truncated", "truncated"),
                                          ("flipped", "corrupted")])
def test_a_damaged_file_raises_naming_it_and_loads_nothing(tmp_path: Path, damage: str, words: str) -> None:
    out = run(2, load_damaged, str(tmp_path / "ckpt"), damage, timeout=SLOW)
    _assert_named_everywhere(out, 1, "__1_0.distcp", words)
    assert all(o["unchanged"] for o in out)  # refused before any weight was written


def load_renamed(path: str) -> dict:
    saved_model = _model("ln_f")
    _save(saved_model, path)
    saved = _full(saved_model)
    strict = _outcome(lambda: _load(_model("norm_f"), path))
    partial = _model("norm_f")
    _perturb(partial)
    _load(partial, path, strict=False)
    got = _full(partial)
    common = [k for k in got if k in saved]
    return {"strict": strict, "common_equal": all(torch.equal(got[k], saved[k]) for k in common),
            "common": common, "renamed_kept": not torch.equal(got["norm_f.weight"], saved["ln_f.weight"])}


def test_a_renamed_module_names_missing_and_unexpected_keys_unless_not_strict(tmp_path: Path) -> None:
    out = run(2, load_renamed, str(tmp_path / "ckpt"), timeout=SLOW)
    for rank in out:
        error = rank["strict"]["error"]
        assert "missing keys" in error and "model.norm_f.weight" in error and "model.norm_f.bias" in error
        assert "unexpected keys" in error and "model.ln_f.weight" in error and "model.ln_f.bias" in error
        assert rank["common"] == ["fc.weight", "fc.bias", "head.weight", "head.bias"]
        assert rank["common_equal"] and rank["renamed_kept"]


@contextlib.contextmanager
def _killed_at_second_move_out_of(path: str):
    """Rank 0's save stops when it moves a second file out of ``path``, as a killed process
    would: no clean-up runs."""
    import parts.comm.dcp_files as files
    real = (files.os.rename, files._recover, files.abandon)
    moves = [0]

    def rename(src, dst):
        if Path(src).parent == Path(path):
            moves[0] += 1
            if moves[0] > 1:
                raise OSError("killed")
        return real[0](src, dst)
    files.os.rename, files._recover, files.abandon = rename, (lambda target: None), (lambda staging: None)
    try:
        yield
    finally:
        files.os.rename, files._recover, files.abandon = real


def load_after_a_save_killed_between_renames(path: str) -> dict:
    import torch.distributed as dist
    model = _model()
    _save(model, path)
    saved = _full(model)
    _perturb(model)
    with _killed_at_second_move_out_of(path) if dist.get_rank() == 0 else contextlib.nullcontext():
        with contextlib.suppress(Exception):
            _save(model, path)
    dist.barrier()
    assert os.path.isdir(path + ".old"), "the save was not interrupted in its swap"
    fresh = _model()
    _perturb(fresh)
    _load(fresh, path)
    return {"same": all(torch.equal(v, saved[k]) for k, v in _full(fresh).items())}


def test_a_save_killed_between_its_renames_leaves_the_old_checkpoint_loadable(tmp_path: Path) -> None:
    out = run(2, load_after_a_save_killed_between_renames, str(tmp_path / "ckpt"), timeout=SLOW)
    assert all(rank["same"] for rank in out)
    assert (tmp_path / "ckpt").is_dir() and not (tmp_path / "ckpt.old").exists()


# ------------------------------------------------------------------ no code from a checkpoint
class _Shell:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def load_crafted(path: str, marker: str) -> dict:
    import torch.distributed as dist
    _save(_model(), path)
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(path) / ".metadata").write_bytes(pickle.dumps(_Shell(f"touch {marker}")))
        (Path(path) / "parts_manifest.json").unlink(missing_ok=True)  # as from a tool writing none
    dist.barrier()
    return _outcome(lambda: _load(_model(), path))


def test_a_metadata_pickle_that_runs_a_command_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    out = run(2, load_crafted, str(tmp_path / "ckpt"), str(marker), timeout=SLOW)
    assert not marker.exists()
    for rank in out:
        assert "refusing to unpickle" in rank["error"] and "system" in rank["error"], rank
        assert ".metadata" in rank["error"]


# ------------------------------------------------------------------ a disk that fills
@pytest.fixture(scope="module")
def small_disk(tmp_path_factory):
    """``mount(bytes) -> directory`` on a tmpfs of that size, or None where mounting is not allowed."""
    mounted = []

    def mount(size: int):
        where = tmp_path_factory.mktemp("tmpfs")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True)
        if done.returncode != 0:
            return None
        mounted.append(where)
        return where
    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=False)


def _bytes_on_tmpfs(directory: Path) -> int:
    return sum(-(-f.stat().st_size // PAGE) * PAGE for f in directory.rglob("*") if f.is_file())


def _disk_for_one_checkpoint(small_disk, measured: Path, tmp_path: Path) -> tuple[Path, bool]:
    """A directory holding one checkpoint like ``measured`` but not two (tmpfs), or a plain one
    where writes will be made to fail instead; and whether it is the tmpfs."""
    size = _bytes_on_tmpfs(measured)
    disk = small_disk(size + size // 2 + 4 * PAGE)
    return (disk, True) if disk is not None else (tmp_path / "plain", False)


def save_twice_onto(path: str, real_disk: bool, width: int) -> dict:
    import torch.distributed as dist
    model = _model(width=width)
    _save(model, path)
    first = _full(model)
    _perturb(model)
    with _writes_fail(not real_disk and dist.get_rank() == 1):
        second = _outcome(lambda: _save(model, path))
    fresh = _model(width=width)
    _load(fresh, path)
    return {"second": second, "loaded_first": all(torch.equal(v, first[k]) for k, v in _full(fresh).items())}


def test_a_disk_filling_during_a_save_over_a_checkpoint_keeps_the_old_one_bitwise(small_disk, tmp_path) -> None:
    width = 2048  # 26.7K parameters: ~107 KiB per save
    run(2, _save_sized, str(tmp_path / "measure"), width, timeout=SLOW)
    disk, real = _disk_for_one_checkpoint(small_disk, tmp_path / "measure", tmp_path)
    out = run(2, save_twice_onto, str(disk / "ckpt"), real, width, timeout=SLOW)
    for rank in out:
        assert "No space left on device" in rank["second"]["error"], rank
        assert rank["loaded_first"]
    assert not (disk / "ckpt.saving").exists()  # the failed save's files are gone


def _save_sized(path: str, width: int) -> None:
    _save(_model(width=width), path)


# ------------------------------------------------------------------ the main recipe
def _recipe_args(out: str):
    if RECIPES not in sys.path:
        sys.path.insert(0, RECIPES)
    import train_gpt
    argv = sys.argv
    sys.argv = ["train_gpt.py", "--dtype", "fp32", "--n-layer", "1", "--n-head", "2", "--n-embd", "64",
                "--seq-len", "16", "--batch-size", "2", "--steps", "4", "--out", out]
    try:
        return train_gpt, train_gpt.parse_args()
    finally:
        sys.argv = argv


def _recipe_step(model, optimizer, schedule, seed: int) -> None:
    from chardata import VOCAB_SIZE
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB_SIZE, (2, 17), generator=generator)
    model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()).backward()
    optimizer.step()
    optimizer.zero_grad()
    schedule.step()


def recipe_save_fill_resume(out: str, real_disk: bool) -> dict:
    import torch.distributed as dist
    train_gpt, args = _recipe_args(out)
    model, _, optimizer, schedule = train_gpt.build(args)
    _recipe_step(model, optimizer, schedule, 1)
    train_gpt.save(out, model, optimizer, schedule, 1)
    good = _full(model)
    _recipe_step(model, optimizer, schedule, 2)
    with _writes_fail(not real_disk and dist.get_rank() == 1):
        second = _outcome(lambda: train_gpt.save(out, model, optimizer, schedule, 2))
    model, _, optimizer, schedule = train_gpt.build(args)
    step = train_gpt.resume(out, model, optimizer, schedule)
    missing = _outcome(lambda: train_gpt.resume(out + "-absent", model, optimizer, schedule))
    return {"second": second, "step": step, "same": all(torch.equal(v, good[k]) for k, v in _full(model).items()),
            "missing": missing}


def recipe_measure(out: str) -> None:
    train_gpt, args = _recipe_args(out)
    model, _, optimizer, schedule = train_gpt.build(args)
    _recipe_step(model, optimizer, schedule, 1)
    train_gpt.save(out, model, optimizer, schedule, 1)


def test_the_recipe_keeps_its_checkpoint_when_the_disk_fills_and_resumes_from_it(small_disk, tmp_path) -> None:
    run(2, recipe_measure, str(tmp_path / "measure"), timeout=SLOW)
    disk, real = _disk_for_one_checkpoint(small_disk, tmp_path / "measure", tmp_path)
    out = run(2, recipe_save_fill_resume, str(disk / "gpt"), real, timeout=SLOW)
    for rank in out:
        assert "No space left on device" in rank["second"]["error"], rank
        assert rank["step"] == 1 and rank["same"], rank
        assert "does not exist" in rank["missing"]["error"] and "gpt-absent" in rank["missing"]["error"]
