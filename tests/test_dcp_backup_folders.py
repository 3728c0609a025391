"""A user's folders named like a save's own (``ck.old``, ``ck.saving``) are never touched.

- A backup ``cp -r ck ck.old`` (with a notes file) and a folder ``ck.saving`` of the user's
  files stay byte for byte through a save of ``ck`` at world 2, which loads the new weights,
  and through a load of ``ck``; the backup still loads as the older checkpoint.
- A checkpoint moved aside (``mv ck ck.old``) stays where it is when ``ck`` is loaded: the
  load raises ``CheckpointError`` naming ``ck``.
- Where both ``ck.saving`` and the save's other name for its staging folder are the user's,
  the save refuses before writing, naming the folder to rename.
- A save killed at any point of its swap, beside those folders, leaves ``ck`` loading the
  previous or the new checkpoint once the next load has finished or undone the swap; the
  user's folders stay byte for byte and nothing of the save's own is left.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest

from dcp_swap import killed_after, load_as, save_as
from harness import run

SLOW = 120.0


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative name to its bytes), and every folder (to None)."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in folder.rglob("*")}


def _user_folders(tmp_path: Path) -> dict[str, dict[str, bytes]]:
    """``run`` saved with seed 1, backed up as ``run.old`` with notes; ``run.saving`` of user files."""
    run(2, save_as, str(tmp_path / "run"), 1, timeout=SLOW)
    shutil.copytree(tmp_path / "run", tmp_path / "run.old")
    (tmp_path / "run.old" / "notes.txt").write_text("the run before the learning-rate change")
    saving = tmp_path / "run.saving"
    (saving / "drafts").mkdir(parents=True)
    (saving / "drafts" / "plan.md").write_text("what to save next")
    (saving / "__0_0.distcp").write_bytes(bytes(range(256)))
    return {name: _tree(tmp_path / name) for name in ("run.old", "run.saving")}


def _now(tmp_path: Path, before: dict[str, dict[str, bytes]]) -> dict[str, dict[str, bytes]]:
    return {name: _tree(tmp_path / name) for name in before}


def test_a_save_keeps_the_users_old_and_saving_folders_byte_for_byte(tmp_path: Path) -> None:
    before = _user_folders(tmp_path)
    run(2, save_as, str(tmp_path / "run"), 2, timeout=SLOW)
    assert _now(tmp_path, before) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run.old", "run.saving"]
    assert run(2, load_as, str(tmp_path / "run"), 2, timeout=SLOW) == [True, True]
    assert run(2, load_as, str(tmp_path / "run.old"), 1, timeout=SLOW) == [True, True]
    assert _now(tmp_path, before) == before


def test_a_load_keeps_the_users_old_and_saving_folders_byte_for_byte(tmp_path: Path) -> None:
    before = _user_folders(tmp_path)
    assert run(2, load_as, str(tmp_path / "run"), 1, timeout=SLOW) == [True, True]
    assert _now(tmp_path, before) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run.old", "run.saving"]


def load_error(path: str) -> str:
    from parts.comm import dcp
    try:
        load_as(path, 1)
    except dcp.CheckpointError as error:
        return str(error)
    return "loaded"


def test_a_load_of_a_checkpoint_moved_aside_leaves_it_where_it_is(tmp_path: Path) -> None:
    run(2, save_as, str(tmp_path / "run"), 1, timeout=SLOW)
    (tmp_path / "run").rename(tmp_path / "run.old")
    before = {"run.old": _tree(tmp_path / "run.old")}
    for said in run(2, load_error, str(tmp_path / "run"), timeout=SLOW):
        assert f"checkpoint {tmp_path / 'run'} does not exist" in said
    assert _now(tmp_path, before) == before and not (tmp_path / "run").exists()


def test_a_save_whose_staging_names_are_both_taken_refuses_naming_the_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import uuid

    from parts.comm import dcp_files
    monkeypatch.setattr(dcp_files.uuid, "uuid4", lambda: uuid.UUID(int=0xABCDEF12 << 96))
    for name in ("run.saving", "run.saving-abcdef12"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text(name)
    with pytest.raises(dcp_files.CheckpointError, match="rename run.saving-abcdef12"):
        dcp_files.begin(tmp_path / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.saving", "run.saving-abcdef12"]
    assert all((tmp_path / n / "mine.txt").read_text() == n for n in ("run.saving", "run.saving-abcdef12"))


def _killed_after(renames: int):
    """Rank 0's save stops after ``renames`` moves of files out of or into ``run`` (or, after
    all of them, when it removes what it moved aside), as a killed process would: no clean-up runs."""
    return killed_after(renames, lambda src, dst: "run" in (Path(src).parent.name, Path(dst).parent.name),
                        lambda path, renamed: renamed > 0)


def save_killed(path: str, renames: int) -> None:
    import torch.distributed as dist
    with _killed_after(renames) if dist.get_rank() == 0 else contextlib.nullcontext():
        with contextlib.suppress(Exception):
            save_as(path, 2)


@pytest.mark.parametrize("renames,seed", [(1, 1), (7, 1), (8, 2)])
def test_a_save_killed_during_its_swap_beside_the_users_folders_recovers_and_keeps_them(
        tmp_path: Path, renames: int, seed: int) -> None:
    # the swap moves the old checkpoint's 4 files (2 shards, .metadata, manifest) aside, then the
    # new one's in, its manifest last (rename 8): until then the previous checkpoint is the one
    before = _user_folders(tmp_path)
    run(2, save_killed, str(tmp_path / "run"), renames, timeout=SLOW)
    assert _now(tmp_path, before) == before
    assert len(list(tmp_path.iterdir())) > 3  # the swap was interrupted: its own folders are left
    assert run(2, load_as, str(tmp_path / "run"), seed, timeout=SLOW) == [True, True]
    assert _now(tmp_path, before) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run.old", "run.saving"]
