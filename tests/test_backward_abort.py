"""A backward that raises half-way, caught by the user who calls ``zero_grad()`` and trains on,
leaves no trace: losses and weights after it equal (bitwise) a run where that step never happened,
in memory and with shards on disk stepped inside ``OffloadedOptimizer.step_in_backward``, at
world 2 and 3 with the exception on every rank.

Reference: the same model on the same seeds, trained on the same batches with the failing step
left out. Bitwise: the same grad bits are reduced in the same order in both runs.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist

from harness import run
from test_coordinator_models import GPT, batch
from test_offload_reliability import _step as reliability_step
from parts.offload import DiskStore, OffloadedOptimizer
from parts.partition import attach, detach, full_state_dict, partitioned, shards
from parts.partition.coordinator import attached_to

FAST = 90.0  # seconds: a regression that hangs fails here
FAILING = 1  # the step whose backward raises
STEPS = 4
# small buckets: when the backward raises, some grads are reduced, some wait in a bucket
KNOBS = dict(prefetch_bucket_size=3000, max_live_parameters=6000, persistence_threshold=60,
             max_reuse_distance=0, reduce_bucket_size=3000)


class Boom(RuntimeError):
    """Raised by ``RaiseInBackward`` half-way through a backward."""


class RaiseInBackward(torch.autograd.Function):
    """The identity forward; its backward raises (a user function failing inside autograd)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise Boom("half-way through backward")


def _raise_after_block1(module, inputs, output):
    return RaiseInBackward.apply(output)


def _build(tmp: str, name: str, disk: bool, debug: bool = False):
    """The model (its shards on disk in a store of its own if ``disk``) and its optimizer."""
    torch.manual_seed(0)
    store = DiskStore(f"{tmp}/{name}{dist.get_rank()}", block_bytes=4096) if disk else None
    with partitioned(remote_device=store):
        model = GPT(layers=3)
    attach(model, **KNOBS, debug=debug)
    opt = torch.optim.AdamW(shards(model), lr=1e-2)
    return model, OffloadedOptimizer(opt, store, chunk_bytes=20_000) if disk else opt, store


def _step(model, opt, step: int, in_backward: bool, fail: bool) -> torch.Tensor:
    """Forward and backward of 4 rows per rank (block 1's output raising in backward if ``fail``)."""
    return reliability_step(model, opt, step, in_backward, _raise_after_block1 if fail else None)


def _train(model, opt, steps, in_backward: bool, zero: str) -> tuple[list, bool]:
    """Train ``steps``; the failing step's exception is caught, then ``zero`` ("optimizer" or
    "model") clears the grads. Returns the losses of the steps that completed, and whether it raised."""
    losses, raised = [], False
    for step in steps:
        if step == FAILING:
            try:
                _step(model, opt, step, in_backward, fail=True)
            except Boom:
                raised = True
            (opt if zero == "optimizer" else model).zero_grad()
            continue
        losses.append(_step(model, opt, step, in_backward, fail=False))
        opt.step()
        opt.zero_grad()
    return losses, raised


def _last_step(model) -> dict:
    """The coordinator's counters of the last step (``steps``, the count of steps ended, left out;
    gathers per parameter in parameter order: the two models' ids differ)."""
    stats = dataclasses.asdict(attached_to(model).stats())
    del stats["steps"]
    stats["param_gathers"] = [n for _, n in sorted(stats["param_gathers"].items())]
    return stats


def body(tmp: str, disk: bool, zero: str) -> dict:
    """The clean run (the failing step left out) against the run with the failure; with ``disk``
    both have their shards on disk and step inside ``step_in_backward``."""
    ref, ref_opt, ref_store = _build(tmp, "ref", disk)
    ref_losses, _ = _train(ref, ref_opt, [s for s in range(STEPS) if s != FAILING], disk, zero)
    model, opt, store = _build(tmp, "faulty", disk)
    losses, raised = _train(model, opt, range(STEPS), disk, zero)
    a, b = full_state_dict(ref), full_state_dict(model)
    out = {"raised": raised, "losses": (ref_losses, losses),
           "same_losses": len(losses) == len(ref_losses) and all(map(torch.equal, ref_losses, losses)),
           "same_weights": sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a),
           "last_step": (_last_step(ref), _last_step(model))}
    detach(ref), detach(model)
    for s in (ref_store, store):
        if s is not None:
            s.close()
    return out


@pytest.mark.parametrize("world,disk,zero", [(2, False, "optimizer"), (3, False, "optimizer"),
                                              (2, False, "model"), (2, True, "optimizer")])
def test_a_caught_backward_exception_leaves_training_as_if_the_step_never_ran(tmp_path, world, disk, zero):
    for out in run(world, body, str(tmp_path), disk, zero, timeout=FAST):
        assert out["raised"]
        assert out["same_losses"], out["losses"]
        assert out["same_weights"]
        assert out["last_step"][0] == out["last_step"][1]  # the same traffic, trace and memory


class _RaiseOnce:
    """A forward hook whose output's grad hook raises in the first backward after ``arm()``."""

    def __init__(self) -> None:
        self.armed = False

    def arm(self) -> None:
        self.armed = True

    def __call__(self, module, inputs, output) -> None:
        output.register_hook(self._grad)

    def _grad(self, grad: torch.Tensor) -> None:
        if self.armed:
            self.armed = False
            raise Boom("half-way through backward")


def body_retry(debug: bool) -> dict:
    """Step 1's backward through a retained graph raises; the user zeroes the optimizer's grads
    and runs the backward again: the same grads and weights as one clean backward."""
    out = {}
    for retry in (False, True):
        model, opt, _ = _build("", "", False, debug)
        fault = _RaiseOnce()
        model.blocks[1].register_forward_hook(fault)
        losses = []
        for step in range(3):
            loss = model(*batch(step, 4, 8 * dist.get_rank()))
            if retry and step == 1:
                fault.arm()
                with contextlib.suppress(Boom):
                    loss.backward(retain_graph=True)
                opt.zero_grad()
            loss.backward()
            losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        out[retry] = (losses, full_state_dict(model))
        detach(model)
    (la, a), (lb, b) = out[False], out[True]
    return {"same_losses": all(map(torch.equal, la, lb)),
            "same_weights": sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)}


@pytest.mark.parametrize("debug", [False, True])
def test_a_backward_retried_after_an_exception_gives_the_clean_grads(debug):
    for out in run(2, body_retry, debug, timeout=FAST):
        assert out == {"same_losses": True, "same_weights": True}
