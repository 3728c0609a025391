"""torch.compile of an attached model trained by a shape-aware optimizer on the whole-tensor path:
``torch.compile(model)`` with Adafactor over ``shards(model)`` equals the eager sharded run."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from harness import run
from test_whole_optim import Shapes

from parts._compat import counting_backend

STEPS = 4
DTYPE = torch.float64


def _train(model: torch.nn.Module, compiled: bool) -> tuple:
    from parts.partition import attach, full_state_dict, route, shards
    rank, world = dist.get_rank(), dist.get_world_size()
    attach(model)
    backend, calls = counting_backend("aot_eager")
    forward = torch.compile(model, backend=backend) if compiled else model
    opt = torch.optim.Adafactor(shards(model), lr=1e-2)
    path = route(opt)
    for step in range(STEPS):
        x = torch.randn(12, 5, generator=torch.Generator().manual_seed(step), dtype=DTYPE)
        forward(x.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    return path, full_state_dict(model, rank0_only=False), calls[0]


def compile_body() -> dict:
    from parts.partition import partition_module
    torch.compiler.reset()
    torch.manual_seed(0)
    reference = Shapes().to(DTYPE)
    eager = _train(partition_module(copy.deepcopy(reference)), False)
    with warnings.catch_warnings():  # torch's own warnings while compiling (not ours)
        warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.")
        compiled = _train(partition_module(copy.deepcopy(reference)), True)
    return {"eager": eager, "compiled": compiled}


def test_compiled_model_with_adafactor_on_the_whole_path_equals_eager() -> None:
    for out in run(2, compile_body, timeout=300):
        (eager_path, eager, _), (path, got, calls) = out["eager"], out["compiled"]
        assert path == eager_path == "whole"
        assert calls >= STEPS  # the compiled graphs ran every step (no silent fallback to eager)
        for k, v in eager.items():  # aot_eager runs eager's kernels: float64 rounding at most
            torch.testing.assert_close(got[k], v, rtol=1e-12, atol=1e-12, msg=k)
