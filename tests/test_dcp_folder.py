"""``parts.comm.dcp.save`` into a folder replaces only the checkpoint's own files.

- A folder that holds the user's files (``config.json``, ``notes.txt``, ``logs/``) keeps them
  across saves at world 3 then 2; the previous checkpoint's files (by its manifest) go, rank
  2's file of the world-3 save among them; the folder loads the last save bitwise.
- ``checkpoint_id=os.getcwd()`` keeps the working directory and its files.
- A save killed at any point of its swap leaves the folder loading either the previous or the
  new checkpoint (the next load finishes or undoes the swap), the user's files kept.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from dcp_swap import killed_after, load_as, save_as
from harness import run

SLOW = 120.0
USER = {"config.json": '{"a": 1}', "notes.txt": "mine", "logs/run.txt": "step 1"}


def _user_files(folder: Path) -> None:
    for name, text in USER.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def _kept(folder: Path) -> bool:
    return all((folder / name).is_file() and (folder / name).read_text() == text for name, text in USER.items())


def test_a_save_into_a_folder_of_user_files_keeps_them_and_replaces_its_own(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    _user_files(folder)
    run(3, save_as, str(folder), 1, timeout=SLOW)
    assert _kept(folder) and (folder / "__2_0.distcp").is_file()
    run(2, save_as, str(folder), 2, timeout=SLOW)
    assert _kept(folder)
    assert not (folder / "__2_0.distcp").exists()  # the world-3 checkpoint's own file is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no .old or .saving left
    assert run(2, load_as, str(folder), 2, timeout=SLOW) == [True, True]


def save_into_cwd(folder: str) -> dict:
    import torch.distributed as dist
    before = os.getcwd()
    os.chdir(folder)
    try:
        for seed in (1, 2):
            save_as(os.getcwd(), seed)
            dist.barrier()
        return {"cwd": os.path.isdir(os.getcwd()) and os.path.samefile(os.getcwd(), folder),
                "kept": _kept(Path(".")), "loads": load_as(".", 2)}
    finally:
        os.chdir(before)


def test_a_save_into_the_working_directory_keeps_it_and_its_files(tmp_path: Path) -> None:
    folder = tmp_path / "work"
    folder.mkdir()
    _user_files(folder)
    for rank in run(2, save_into_cwd, str(folder), timeout=SLOW):
        assert rank == {"cwd": True, "kept": True, "loads": True}


def _killed_after(renames: int):
    """Rank 0's save stops after ``renames`` renames of its swap (or, after all of them, when it
    removes what it moved aside), as a killed process would: no clean-up runs."""
    return killed_after(renames, lambda src, dst: Path(dst).parent.name in ("run", "run.old"),
                        lambda path, renamed: Path(path).name == "run.old")


def save_killed(path: str, renames: int) -> None:
    import torch.distributed as dist
    save_as(path, 1)
    with _killed_after(renames) if dist.get_rank() == 0 else contextlib.nullcontext():
        with contextlib.suppress(Exception):
            save_as(path, 2)


@pytest.mark.parametrize("renames,seed", [(1, 1), (5, 1), (7, 1), (8, 2)])
def test_a_save_killed_during_its_swap_loads_the_previous_or_the_new_checkpoint(
        tmp_path: Path, renames: int, seed: int) -> None:
    # the swap moves the old checkpoint's 4 files (2 shards, .metadata, manifest) aside, then the
    # new one's in, its manifest last (rename 8): until then the previous checkpoint is the one
    folder = tmp_path / "run"
    folder.mkdir()
    _user_files(folder)
    run(2, save_killed, str(folder), renames, timeout=SLOW)
    assert (tmp_path / "run.old").is_dir()  # the swap was interrupted
    assert run(2, load_as, str(folder), seed, timeout=SLOW) == [True, True]
    assert _kept(folder) and not (tmp_path / "run.old").exists()
