"""The communication device: which device it is, what a global norm costs on it, and that
nothing follows ``torch.set_default_device``.

* ``comm_device``: the CPU for gloo and without a group, the declared device inside
  ``declared_comm_device``; ``torch_algorithms`` turns the gloo algorithms off and back on;
* a global norm (``clip_grad_norm_``, ``BF16Optimizer.step`` with clipping) on a model whose
  device is not the CPU (meta, with meta declared the communication device) costs one
  ``_foreach_norm``, one all-reduce and one host read of a device tensor;
* training at world 2 under ``torch.set_default_device("meta")`` (offload with a step during
  backward, clipping, debug mode; BF16Optimizer with clipping) equals the same run without it,
  bitwise.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from harness import run
from placement_audit import Audit, MetaValues, auditing, default_device, fake_group
from test_placement_audit import DIM, _model
from parts._compat import TorchDispatchMode
from parts.comm import comm_device, declared_comm_device, gloo_algorithms, group_info, torch_algorithms
from parts.optim import BF16Optimizer
from parts.partition import attach, clip_grad_norm_, detach, full_state_dict, shards


def _rule() -> dict:
    info = group_info(None)
    with declared_comm_device("meta"):
        declared = comm_device(info)
    with torch_algorithms():
        forced = gloo_algorithms()
    return dict(gloo=comm_device(info), declared=declared, forced=forced, plain=gloo_algorithms())


def test_the_comm_device_is_the_cpu_on_gloo_and_the_declared_one_when_declared():
    assert comm_device(group_info(None)) == torch.device("cpu")  # no process group
    for out in run(2, _rule):
        assert out == dict(gloo=torch.device("cpu"), declared=torch.device("meta"), forced=False, plain=True)


class _Costs(TorchDispatchMode):
    """Counts ``_foreach_norm`` calls and host reads (``.item()`` and the like) of meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._foreach_norm.Scalar:
            self.counts["foreach_norm"] += 1
        on_meta = bool(args) and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta"
        if on_meta and func is torch.ops.aten._local_scalar_dense.default:
            self.counts["host_reads"] += 1
        return func(*args, **(kwargs or {}))


def _norm_costs(kind: str) -> Counter:
    audit = Audit("meta")
    with declared_comm_device("meta"), auditing(audit), MetaValues():
        model = _model(device="meta")
        attach(model, persistence_threshold=0)
        opt = BF16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), clip_grad=1.0, allow_fp32=True,
                            named_parameters=model.named_parameters()) if kind == "bf16" else None
        model(torch.randn(4, DIM, device="meta")).square().mean().backward()
        before = Counter(audit.calls)
        with _Costs() as costs:
            clip_grad_norm_(model, 1.0) if opt is None else opt.step()
    assert not audit.take()
    return costs.counts + Counter(all_reduce=(audit.calls - before)["all_reduce"])


@pytest.mark.parametrize("kind", ["clip_grad_norm_", "bf16"])
def test_a_global_norm_costs_one_foreach_norm_one_all_reduce_one_host_read(kind):
    with fake_group(2):
        assert _norm_costs(kind) == Counter(foreach_norm=1, all_reduce=1, host_reads=1)


def _train(tmp: str, kind: str, meta_default: bool) -> dict:
    from parts.offload import DiskStore, OffloadedOptimizer
    rank = dist.get_rank()
    store = DiskStore(f"{tmp}/{int(meta_default)}r{rank}", block_bytes=4096) if kind == "offload" else None
    model = _model(remote_device=store)
    attach(model, persistence_threshold=0, debug=kind == "offload")
    if kind == "offload":
        opt = OffloadedOptimizer(torch.optim.SGD(shards(model), lr=0.1, momentum=0.9), store)
        backward = opt.step_in_backward
    else:
        opt = BF16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), clip_grad=0.05,
                            allow_fp32=True, named_parameters=model.named_parameters())
        backward = contextlib.nullcontext
    g, losses = torch.Generator().manual_seed(5 + rank), []
    with default_device("meta") if meta_default else contextlib.nullcontext():
        for _ in range(3):
            loss = model(torch.randn(4, DIM, generator=g, device="cpu")).square().mean()
            with backward():
                loss.backward()
            if kind == "offload":
                clip_grad_norm_(model, 1e9)  # the norm of grads a step consumed: never scales them
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    state = full_state_dict(model, rank0_only=False)
    detach(model)
    if store is not None:
        store.close()
    return dict(losses=losses, state=state)


def _both(tmp: str, kind: str) -> bool:
    plain, meta = _train(tmp, kind, False), _train(tmp, kind, True)
    return (all(torch.equal(a, b) for a, b in zip(plain["losses"], meta["losses"]))
            and all(torch.equal(plain["state"][k], meta["state"][k]) for k in plain["state"]))


@pytest.mark.parametrize("kind", ["offload", "bf16"])
def test_training_under_set_default_device_meta_equals_the_plain_run(tmp_path, kind):
    assert run(2, _both, str(tmp_path), kind, timeout=120) == [True, True]
