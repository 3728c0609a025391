"""Crash-safe checkpoint files: atomic replace, manifest, refusal of damaged files."""

import os
import signal

import pytest
import torch

import parts.io as pio
from harness import RankFailure, run


def _state(seed):
    generator = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(7, 3, generator=generator), "b": torch.zeros(3)},
            "optimizer": {"step": seed, "exp_avg": [torch.randn(5, generator=generator)]}}


def _assert_same(left, right):
    assert torch.equal(left["model"]["w"], right["model"]["w"])
    assert torch.equal(left["optimizer"]["exp_avg"][0], right["optimizer"]["exp_avg"][0])
    assert left["optimizer"]["step"] == right["optimizer"]["step"]


def test_round_trip_and_manifest(tmp_path):
    path = tmp_path / "ckpt.pt"
    pio.save(_state(1), path, world_size=2, step=10)
    _assert_same(pio.load(path), _state(1))
    manifest = pio.read_manifest(path)
    assert (manifest["world_size"], manifest["step"]) == (2, 10)
    assert manifest["tensors"]["model.w"] == {"shape": [7, 3], "dtype": "float32"}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary left behind


def test_truncated_file_is_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    pio.save(_state(1), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(pio.CheckpointError, match="truncated"):
        pio.load(path)


def test_corrupted_payload_is_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    pio.save(_state(1), path)
    data = bytearray(path.read_bytes())
    data[-50] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(pio.CheckpointError, match="corrupted"):
        pio.load(path)


def test_foreign_and_missing_files_are_refused(tmp_path):
    foreign = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2)}, foreign)
    with pytest.raises(pio.CheckpointError, match="not a parts checkpoint"):
        pio.load(foreign)
    with pytest.raises(pio.CheckpointError, match="does not exist"):
        pio.load(tmp_path / "nothing.pt")


def _kill_while_saving(path, where):
    """Save once, then die (SIGKILL) in the middle of saving a second time."""
    pio.save(_state(1), path, step=1)
    if where == "before-rename":
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
    else:  # half of the new bytes are on disk when the process dies
        real_fdopen = os.fdopen

        def dying_fdopen(fd, mode):
            handle = real_fdopen(fd, mode)
            real_write = handle.write

            def write(data):
                real_write(data[: len(data) // 2])
                handle.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            handle.write = write
            return handle
        os.fdopen = dying_fdopen
    pio.save(_state(2), path, step=2)


@pytest.mark.parametrize("where", ["before-rename", "mid-write"])
def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path, where):
    path = tmp_path / "ckpt.pt"
    with pytest.raises(RankFailure, match="died"):
        run(1, _kill_while_saving, str(path), where, timeout=30)
    _assert_same(pio.load(path), _state(1))
    assert pio.read_manifest(path)["step"] == 1


def test_load_never_unpickles_code(tmp_path, monkeypatch):
    path = tmp_path / "evil.pt"
    monkeypatch.setattr(pio, "check_loadable", lambda obj: None)  # save refuses it; force the file

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    pio.save({"x": Evil()}, path)  # torch.save pickles it; weights_only loading must refuse
    with pytest.raises(pio.CheckpointError, match="cannot read its payload"):
        pio.load(path)
