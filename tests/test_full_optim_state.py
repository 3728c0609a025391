"""``full_optimizer_state_dict``: the optimizer state of a sharded model at full parameter shapes
equals the same optimizer's state on the unsharded model in one process (float64, uneven shapes),
on the shard path (AdamW) and the whole-tensor path (Adafactor, state on owner ranks), at world
2 and 3; ``rank0_only`` keeps it on rank 0."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from harness import run
from test_whole_optim import Shapes

STEPS = 3
DTYPE = torch.float64
OPTIMIZERS = {"AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
              "Adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2)}


def _batch(step: int) -> torch.Tensor:
    return torch.randn(6 * 6, 5, generator=torch.Generator().manual_seed(step), dtype=DTYPE)


def _by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The plain optimizer's state keyed by parameter name, tensors cloned."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for p, s in optimizer.state.items()}


def body(name: str) -> dict:
    from parts.partition import attach, full_optimizer_state_dict, partition_module, route, shards
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = Shapes().to(DTYPE)
    model = partition_module(copy.deepcopy(reference))
    attach(model)
    ref_opt, opt = OPTIMIZERS[name](reference.parameters()), OPTIMIZERS[name](shards(model))
    for step in range(STEPS):
        reference(_batch(step)).backward()
        model(_batch(step).chunk(world)[rank]).backward()
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
    full = full_optimizer_state_dict(model, opt, rank0_only=False)
    kept = full_optimizer_state_dict(model, opt)
    return {"path": route(opt), "full": full, "kept": bool(kept), "expected": _by_name(reference, ref_opt),
            "groups": full["param_groups"], "names": [n for n, _ in reference.named_parameters()]}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_full_optimizer_state_equals_one_process(name: str, world: int) -> None:
    results = run(world, body, name, timeout=120)
    assert results[0]["path"] == ("whole" if name == "Adafactor" else "shard")
    for rank, r in enumerate(results):
        assert r["kept"] == (rank == 0)
        assert sorted(r["full"]["state"]) == sorted(r["expected"]) == sorted(r["names"])
        assert sorted(n for g in r["groups"] for n in g["params"]) == sorted(r["names"])
        for fqn, expected in r["expected"].items():
            got = r["full"]["state"][fqn]
            assert sorted(got) == sorted(expected), fqn
            for key, value in expected.items():
                if not torch.is_tensor(value) or value.dim() == 0:
                    assert float(got[key]) == float(value), (fqn, key)
                    continue
                assert got[key].shape == value.shape, (fqn, key)
                error = float((got[key] - value).norm() / value.norm().clamp_min(1e-300))
                assert error < 1e-9, (rank, fqn, key, error)
