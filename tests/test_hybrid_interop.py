"""A hybrid (2 x 2) checkpoint, weights and Adam state, crosses to FSDP2 HSDP and back, and into
full sharding at the same world size: every value bitwise."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from harness import run

SLOW = 240.0  # DCP's first import in a worker takes seconds on a loaded 2-core machine


def _model() -> nn.Module:
    """Odd sizes: shards of uneven length on the shard group, padding on its last rank."""
    return nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 3))


def _mesh(replicas: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (replicas, dist.get_world_size() // replicas),
                            mesh_dim_names=("replicate", "shard"))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One Adam step on this rank's rows of a batch drawn from ``seed``."""
    import torch.distributed as dist
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 7, generator=g), torch.randn(8, 3, generator=g)
    rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
    optimizer.step()
    optimizer.zero_grad()


def parts_side(load_from: str | None, save_to: str, hybrid: bool) -> dict:
    """parts, hybrid (a 2 x 2 mesh) or fully sharded: trains a step or loads ``load_from``, then saves
    weights and Adam state through ``parts.comm.dcp``; its full weights."""
    import torch.distributed as dist
    from parts.comm import dcp
    from parts.partition import (attach, full_state_dict, load_sharded_optimizer_state_dict,
                                 load_sharded_state_dict, partitioned, sharded_optimizer_state_dict,
                                 sharded_state_dict, shards)
    torch.manual_seed(10 + dist.get_rank())
    with partitioned(mesh=_mesh(2) if hybrid else None):
        model = _model()
    attach(model)
    optimizer = torch.optim.Adam(shards(model), lr=0.1)
    if load_from is None:
        _step(model, optimizer, seed=1)
    else:
        state = {"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=load_from)
        load_sharded_state_dict(model, state["model"])
        load_sharded_optimizer_state_dict(model, optimizer, state["optim"])
    dcp.save({"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, optimizer)},
             checkpoint_id=save_to)
    return full_state_dict(model, rank0_only=False)


def fsdp2_hsdp_side(load_from: str, resave_to: str, save_to: str) -> tuple[dict, dict]:
    """FSDP2 HSDP (``fully_shard`` on a 2 x 2 mesh) loads ``load_from`` and saves it again into
    ``resave_to``, trains a step and saves into ``save_to``; its full weights after the load and
    after the step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(20)
    model, mesh = _model(), _mesh(2)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=load_from)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    full = StateDictOptions(full_state_dict=True)
    loaded = {k: v.clone() for k, v in get_model_state_dict(model, options=full).items()}
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=resave_to)
    _step(model, optimizer, seed=2)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=save_to)
    return loaded, {k: v.clone() for k, v in get_model_state_dict(model, options=full).items()}


def _read(directory: Path) -> dict:
    """A DCP directory as one dict of full tensors (torch's own converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    single = directory.with_suffix(".pt")
    dcp_to_torch_save(directory, single)
    return torch.load(single, weights_only=True)


def _flat(tree: object, prefix: str = "") -> dict:
    """Nested dicts and lists as ``{dotted key: leaf}``."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    return {k: v for key, sub in items for k, v in _flat(sub, f"{prefix}.{key}" if prefix else str(key)).items()}


def _same(a: dict, b: dict) -> bool:
    """Equal keys and equal values, tensors bitwise (dtype included)."""
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype if torch.is_tensor(a[k]) else a[k] == b[k]
               for k in a)


def test_hybrid_checkpoint_crosses_to_fsdp2_hsdp_and_back_bitwise(tmp_path: Path) -> None:
    ours, resaved, theirs, back = (tmp_path / name for name in ("parts_hybrid", "resaved", "fsdp2_hsdp", "back"))
    trained = run(4, parts_side, None, str(ours), True, timeout=SLOW)
    hsdp = run(4, fsdp2_hsdp_side, str(ours), str(resaved), str(theirs), timeout=SLOW)
    assert all(_same(r, trained[0]) for r in trained)  # replicas identical after the step
    assert all(_same(loaded, trained[0]) for loaded, _ in hsdp)  # parts hybrid -> FSDP2 HSDP
    saved = _flat(_read(ours))
    assert any(k.startswith("optim.state.") and k.endswith("exp_avg_sq") for k in saved)
    assert _same(_flat(_read(resaved)), saved)  # Adam's state too: FSDP2 saves again what it loaded
    stepped = hsdp[0][1]
    assert all(_same(s, stepped) for _, s in hsdp) and not _same(stepped, trained[0])  # FSDP2 trained on
    theirs_saved = _flat(_read(theirs))
    for hybrid in (True, False):  # FSDP2 HSDP -> parts hybrid 2 x 2, and -> parts full shard at world 4
        loaded = run(4, parts_side, str(theirs), str(back), hybrid, timeout=SLOW)
        assert all(_same(r, stepped) for r in loaded)
        assert _same(_flat(_read(back)), theirs_saved)  # weights and Adam's state, saved again
