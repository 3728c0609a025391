"""``parts.export``: a sharded DCP checkpoint (parts or FSDP2, world 2 and 3, uneven shards) to
safetensors that ``from_pretrained`` and ``load_pretrained`` read bit for bit, streamed."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from harness import run

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

VOCAB = 61  # rows of wte: uneven at world 2 and 3


def _config() -> "transformers.GPT2Config":
    return transformers.GPT2Config(n_layer=2, n_embd=24, n_head=2, vocab_size=VOCAB, n_positions=20)


def _parts_save(path: str) -> dict:
    """A trained-looking sharded GPT-2 saved by parts (``sharded_state_dict``), config beside it."""
    import torch.distributed as dist
    from parts.comm import dcp
    from parts.partition import full_state_dict, partitioned, sharded_state_dict
    torch.manual_seed(0)
    with partitioned():
        model = transformers.GPT2LMHeadModel(_config())
    dcp.save(sharded_state_dict(model), checkpoint_id=path)
    if dist.get_rank() == 0:
        model.config.save_pretrained(path)
    dist.barrier()
    return full_state_dict(model, rank0_only=False)


def _fsdp2_save(path: str) -> dict:
    """The same model sharded by FSDP2 (``fully_shard`` per block), saved by torch's ``dcp.save``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_config())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    if dist.get_rank() == 0:
        model.config.save_pretrained(path)
    dist.barrier()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in full.items()}


def _loaded_back(folder: str) -> dict:
    """A fresh sharded model filled by ``load_pretrained`` from the exported files."""
    from parts.partition import full_state_dict, load_pretrained, partitioned
    torch.manual_seed(5)
    with partitioned():
        model = transformers.GPT2LMHeadModel(_config())
    keys = load_pretrained(model, folder, strict=False)  # lm_head.weight: tied, one parameter here
    return dict(state=full_state_dict(model, rank0_only=False), missing=keys.missing_keys,
                unexpected=keys.unexpected_keys)


def _same(a: dict, b: dict) -> bool:
    common = set(a) & set(b)
    return len(common) > 0 and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in common)


@pytest.mark.parametrize("saver,world", [(_parts_save, 2), (_parts_save, 3), (_fsdp2_save, 2), (_fsdp2_save, 3)])
def test_exported_checkpoint_loads_bit_for_bit(tmp_path, saver, world):
    from parts.export import export
    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "hf"
    full = run(world, saver, ckpt, timeout=120)[0]
    prefix = "model" if saver is _fsdp2_save else ""
    result = export(ckpt, out, max_shard_size="20KB", prefix=prefix)  # split into several files
    assert len(result.files) > 1 and result.index is not None and (out / "config.json").is_file()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).state_dict()
    params = {k for k, _ in transformers.GPT2LMHeadModel(_config()).named_parameters()}
    assert params <= set(loaded) and set(full) >= params
    assert _same(loaded, full) and all(k in set(full) & set(loaded) for k in params)
    back = run(world, _loaded_back, str(out), timeout=120)[0]
    assert back["missing"] == [] and set(back["unexpected"]) <= {"lm_head.weight"}
    assert _same(back["state"], full) and set(back["state"]) == set(full)


def test_cli_casts_floats_and_writes_one_file(tmp_path):
    from parts.export.__main__ import main
    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "hf"
    full = run(2, _parts_save, ckpt, timeout=120)[0]
    assert main([ckpt, str(out), "--dtype", "bfloat16"]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    from safetensors.torch import load_file
    got = load_file(out / "model.safetensors")
    assert got.keys() == full.keys()
    assert all(torch.equal(got[k], full[k].to(torch.bfloat16)) for k in full)


_RSS_JOB = textwrap.dedent("""
    import json, resource, sys
    import torch
    from parts.export import export
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = export(sys.argv[1], sys.argv[2], max_shard_size="16MB")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(dict(growth=peak - base, total=result.total_bytes)))
""")


def _big_save(path: str, tensors: int, rows: int) -> None:
    """Many tensors of ``rows`` x 1024 fp32 each, sharded over the group by parts."""
    from parts.comm import dcp
    from parts.partition import partitioned, sharded_state_dict
    torch.manual_seed(0)
    with partitioned():
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, rows, bias=False) for _ in range(tensors)])
    dcp.save(sharded_state_dict(model), checkpoint_id=path)


def test_export_peak_memory_stays_within_the_bound(tmp_path):
    # 48 MiB of weights, stored pieces of 0.5 MiB (1 MiB tensors at world 2): the export holds a
    # few pieces at a time, so its peak RSS grows by less than the bound, 1/6 of the model
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    run(2, _big_save, ckpt, 48, 256, timeout=120)
    job = subprocess.run([sys.executable, "-c", _RSS_JOB, ckpt, out], capture_output=True, text=True,
                         check=True)
    got = json.loads(job.stdout.strip().splitlines()[-1])
    bound = 8 * 2**20
    assert got["total"] == 48 * 2**20 and got["total"] >= 6 * bound
    assert got["growth"] <= bound, got
