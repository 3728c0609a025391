"""``parts.export`` is all or nothing, and finds the model in the folders users point it at.

- An earlier export's weight files in the output folder go (a stale ``model.safetensors``
  beside new shards would be what ``from_pretrained`` loads); other files stay.
- A failed export (a bit flip, a truncated piece, a disk that fills, too little free space,
  metadata declaring a 4 TiB tensor) leaves no weight file and no partial file: the output
  folder is as it was.
- The output folder cannot be the checkpoint folder.
- A parts Trainer's ``checkpoint-N/`` and an accelerate ``save_state`` folder export as the
  model inside them; a run's output folder says which checkpoint to point at.
"""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness import run

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
SLOW = 120.0


def _config() -> "transformers.GPT2Config":
    return transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=37, n_positions=8)


def save_gpt(path: str, seed: int) -> dict:
    """A sharded GPT-2 saved by ``parts.comm.dcp`` with its config beside it; its full weights."""
    import torch.distributed as dist
    from parts.comm import dcp
    from parts.partition import full_state_dict, partitioned, sharded_state_dict
    torch.manual_seed(seed)
    with partitioned():
        model = transformers.GPT2LMHeadModel(_config())
    dcp.save(sharded_state_dict(model), checkpoint_id=path)
    if dist.get_rank() == 0:
        model.config.save_pretrained(path)
    dist.barrier()
    return full_state_dict(model, rank0_only=False)


def _loads(folder: Path, full: dict) -> bool:
    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)
    state = loaded.state_dict()
    return not info["missing_keys"] and all(torch.equal(state[k], v) for k, v in full.items())


def _listing(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())} if folder.exists() else {}


def test_an_earlier_exports_weight_files_are_removed_and_other_files_kept(tmp_path: Path) -> None:
    from parts.export import export
    first, second = run(2, save_gpt, str(tmp_path / "a"), 1, timeout=SLOW)[0], \
        run(2, save_gpt, str(tmp_path / "b"), 2, timeout=SLOW)[0]
    out = tmp_path / "hf"
    export(tmp_path / "a", out)  # one model.safetensors
    (out / "README.md").write_text("mine")
    assert _loads(out, first)
    result = export(tmp_path / "b", out, max_shard_size="10KB")  # shards and an index
    assert [p.name for p in result.removed] == ["model.safetensors"]
    assert not (out / "model.safetensors").exists() and (out / "README.md").read_text() == "mine"
    assert _loads(out, second)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "hf"]  # no staging folder left


def _flip(folder: Path) -> None:
    data = folder / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))


def _truncate_without_manifest(folder: Path) -> None:  # as torch's dcp.save leaves it: unverified
    (folder / "parts_manifest.json").unlink()
    data = folder / "__1_0.distcp"
    os.truncate(data, data.stat().st_size - 200)


def _huge(folder: Path) -> None:
    """``.metadata`` declaring one weight as 2^20 x 2^20 (4 TiB of float32)."""
    (folder / "parts_manifest.json").unlink()
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    entry = metadata.state_dict_metadata["transformer.wte.weight"]
    entry.size = torch.Size([2 ** 20, 2 ** 20])
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


class _DiskFull:
    def __init__(self, monkeypatch) -> None:
        import parts.export.safetensors as st
        real = st._pwrite_all
        calls = [0]

        def pwrite(fd, data, offset):
            calls[0] += 1
            if calls[0] > 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            real(fd, data, offset)
        monkeypatch.setattr(st, "_pwrite_all", pwrite)


@pytest.mark.parametrize("damage", ["flip", "truncate", "huge", "full", "nospace"])
def test_a_failed_export_leaves_the_output_folder_as_it_was(tmp_path: Path, damage: str, monkeypatch) -> None:
    from parts.export import export
    earlier = run(2, save_gpt, str(tmp_path / "a"), 1, timeout=SLOW)[0]
    run(2, save_gpt, str(tmp_path / "b"), 2, timeout=SLOW)
    fresh, kept = tmp_path / "fresh", tmp_path / "kept"
    export(tmp_path / "a", kept)
    before = _listing(kept)
    if damage == "full":
        _DiskFull(monkeypatch)
    elif damage == "nospace":
        import parts.export.output as output
        monkeypatch.setattr(output.shutil, "disk_usage", lambda path: SimpleNamespace(total=10**9, free=1000))
    else:
        {"flip": _flip, "truncate": _truncate_without_manifest, "huge": _huge}[damage](tmp_path / "b")
    for out in (fresh, kept):
        with pytest.raises((OSError, RuntimeError, ValueError)) as raised:
            export(tmp_path / "b", out, max_shard_size="10KB")
        if damage == "huge":
            assert "transformer.wte.weight cover 592 of the 1099511627776 elements" in str(raised.value)
        if damage == "nospace":
            assert "bytes are free" in str(raised.value) and str(out) in str(raised.value)
    assert not fresh.exists() and _listing(kept) == before and _loads(kept, earlier)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "kept"]  # no staging, no partial file


def test_an_export_into_the_checkpoint_folder_is_refused_up_front(tmp_path: Path) -> None:
    from parts.export import export
    run(2, save_gpt, str(tmp_path / "ckpt"), 1, timeout=SLOW)
    before = _listing(tmp_path / "ckpt")
    for out in (tmp_path / "ckpt", tmp_path / "ckpt" / "hf"):
        with pytest.raises(ValueError, match="is the checkpoint folder .*ckpt"):
            export(tmp_path / "ckpt", out)
    assert _listing(tmp_path / "ckpt") == before


# ------------------------------------------------------------------ Trainer and accelerate folders
class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        ids = (torch.arange(8) * (i + 1)) % 37
        return {"input_ids": ids, "labels": ids}


def trainer_run(out: str) -> dict:
    from parts.integrations.transformers import Trainer
    from parts.partition import full_state_dict, partitioned
    torch.manual_seed(0)
    with partitioned():
        model = transformers.GPT2LMHeadModel(_config())
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # accelerate warns without it; workers run one thread
    args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=2,
                                          save_steps=2, report_to=[], use_cpu=True, logging_steps=100,
                                          save_only_model=True, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=Rows()).train()
    return full_state_dict(model, rank0_only=False)


def accelerate_run(out: str) -> dict:
    from accelerate.state import AcceleratorState, GradientState

    from parts.integrations.accelerate import Accelerator, prepare
    from parts.partition import full_state_dict, partitioned
    AcceleratorState._reset_state()
    GradientState._reset_state()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    with partitioned():
        model = transformers.GPT2LMHeadModel(_config())
    model, optimizer = prepare(accelerator, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    accelerator.save_state(out)
    return full_state_dict(model, rank0_only=False)


def test_a_trainer_checkpoint_folder_exports_the_model_inside_it(tmp_path: Path) -> None:
    from parts.export.__main__ import main
    from parts.export import export
    full = run(2, trainer_run, str(tmp_path / "runA"), timeout=SLOW)[0]
    assert main([str(tmp_path / "runA" / "checkpoint-2"), str(tmp_path / "hf")]) == 0
    assert _loads(tmp_path / "hf", full)
    with pytest.raises(RuntimeError, match="point at one of its checkpoints, e.g. the latest, .*checkpoint-2"):
        export(tmp_path / "runA", tmp_path / "hf2")


def test_an_accelerate_save_state_folder_exports_the_model_inside_it(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from parts.export import export
    full = run(2, accelerate_run, str(tmp_path / "state"), timeout=SLOW)[0]
    result = export(tmp_path / "state", tmp_path / "hf")
    assert result.checkpoint == tmp_path / "state" / "parts_model_0"
    from safetensors.torch import load_file
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert got.keys() == full.keys() and all(torch.equal(got[k], v) for k, v in full.items())
