"""Bad input gets a clear error: one table row per bad input (callable, exception, message fragment).

Local rows run in this process (no process group: a world of one). Rows that need ranks
(a ``group`` without this rank, a verdict rank 0 must broadcast, mismatched groups) run at
world 2 through the harness; every rank listed in the row must raise the expected type
with the expected fragment (the fragment names the parameter, module, key, knob or rank).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run
from torch import nn

from parts.checkpoint import CheckpointPolicy, ContiguousBuffers, checkpoint
from parts.partition import (ShardLayout, gather, gathered, load_full_state_dict, full_state_dict,
                             partition_module, partitioned, reduce_scatter_grads, release, shards)


def _coordinator_api():
    """(FetchCoordinator, attach): public names if exported, else the coordinator module."""
    import parts.partition as pp
    if hasattr(pp, "attach"):
        return pp.FetchCoordinator, pp.attach
    from parts.partition.coordinator import FetchCoordinator, attach
    return FetchCoordinator, attach


@dataclass(frozen=True)
class Row:
    """One bad input: ``fn()`` must raise ``exc`` with ``fragment`` in its message."""

    id: str
    fn: Callable[[], object]
    exc: type
    fragment: str
    ranks: tuple = (0, 1)  # rank rows: the ranks that must raise (the others must return)
    others: type = type(None)  # rank rows: what the other ranks raise naming the same ranks (None: they return)


def _params(rows: list) -> list:
    """pytest params of ``rows``, named by their ids."""
    return [pytest.param(r, id=r.id) for r in rows]


# ------------------------------------------------------------------------------ models
def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def _sharded() -> nn.Module:
    return partition_module(_net())


def _plain_sd() -> dict:
    return {k: v.clone() for k, v in _net().state_dict().items()}


def _sd(**changes) -> dict:
    """The plain state dict with keys replaced (value None drops the key)."""
    sd = _plain_sd()
    for key, value in changes.items():
        key = key.replace("__", ".")
        if value is None:
            sd.pop(key)
        else:
            sd[key] = value
    return sd


# ------------------------------------------------------------------------ row bodies
def _released_matmul():
    model = _sharded()
    return F.linear(torch.randn(2, 3), model[0].weight)


def _released_add():
    return _sharded()[0].weight + 1


def _exhausted_buffers():
    policy = CheckpointPolicy(buffers=ContiguousBuffers(1))
    lin = nn.Linear(3, 3)
    x = lin(torch.randn(2, 3, requires_grad=True))  # an activation (not a leaf): it is buffered
    checkpoint(lin, x, policy=policy)
    checkpoint(lin, x, policy=policy)


def _build_under(**kwargs):
    with partitioned(**kwargs):
        nn.Linear(2, 2)


def _attach_unsharded():
    _, attach = _coordinator_api()
    attach(_net())


def _attach_half_sharded():
    _, attach = _coordinator_api()
    model = nn.Sequential(partition_module(nn.Linear(3, 4)), nn.Linear(4, 2))
    attach(model)


def _attach_twice():
    _, attach = _coordinator_api()
    model = _sharded()
    attach(model)
    attach(model)


def _knob(**knobs):
    FetchCoordinator, _ = _coordinator_api()
    return lambda: FetchCoordinator(**knobs)


def _bf16(*params, **kwargs):
    from parts.optim import BF16Optimizer
    return BF16Optimizer(torch.optim.AdamW(list(params), lr=1e-3), **kwargs)


def _bf16_params(n=2, dtype=torch.bfloat16):
    return [nn.Parameter(torch.randn(5, dtype=dtype)) for _ in range(n)]


def _opt_mixed_dtype():
    a, b = _bf16_params()
    _bf16(a, nn.Parameter(torch.randn(5)))


def _opt_other_device():
    a, _ = _bf16_params()
    _bf16(a, nn.Parameter(torch.randn(5, dtype=torch.bfloat16, device="meta")))


def _opt_twice():
    a, _ = _bf16_params()
    from parts.optim import BF16Optimizer
    BF16Optimizer(torch.optim.AdamW([{"params": [a]}, {"params": [a]}], lr=1e-3))


def _opt_twice_in_group():
    a, _ = _bf16_params()
    from parts.optim import BF16Optimizer
    with warnings.catch_warnings():  # torch only warns about a duplicate inside one group
        warnings.simplefilter("ignore", UserWarning)
        inner = torch.optim.AdamW([a, a], lr=1e-3)
    BF16Optimizer(inner)


def _opt_knob(**kwargs):
    return lambda: _bf16(*_bf16_params(), **kwargs)


def _opt_load(saved_shapes, loaded_shapes):
    """Save an optimizer over params of ``saved_shapes``; load it into one over ``loaded_shapes``."""
    from parts.optim import BF16Optimizer

    def build(shapes):
        named = [(name, nn.Parameter(torch.randn(shape, dtype=torch.bfloat16)))
                 for name, shape in shapes.items()]
        opt = BF16Optimizer(torch.optim.AdamW([p for _, p in named], lr=1e-3), named_parameters=named)
        return opt, named

    saved, named = build(saved_shapes)
    loss = sum(p.float().sum() for _, p in named)
    loss.backward()
    saved.step()
    target, _ = build(loaded_shapes)
    return lambda: target.load_state_dict(saved.state_dict())


def _scaler(**kwargs):
    from parts.optim import DynamicLossScaler
    return DynamicLossScaler(**kwargs)


def _as_int(obj):
    """``obj`` with every floating-point tensor cast to int64 (a state dict of the wrong dtype)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(torch.int64) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _as_int(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_as_int(v) for v in obj]
    return obj


def _opt_load_int_state():
    from parts.optim import BF16Optimizer
    a = nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
    saved = BF16Optimizer(torch.optim.AdamW([a], lr=1e-3), named_parameters=[("a", a)])
    a.float().sum().backward()
    saved.step()
    b = nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
    target = BF16Optimizer(torch.optim.AdamW([b], lr=1e-3), named_parameters=[("a", b)])
    target.load_state_dict(_as_int(saved.state_dict()))


# ---------------------------------------------------------------------------- the table
LOCAL_ROWS = [
    # gather / release / reduce-scatter / shards of a parameter that is not sharded
    Row("gather-unsharded", lambda: gather([nn.Linear(3, 4).weight]), TypeError, "(4, 3) is not a partitioned"),
    Row("release-unsharded", lambda: release([nn.Linear(3, 4).weight]), TypeError, "(4, 3) is not a partitioned"),
    Row("reduce-scatter-unsharded", lambda: reduce_scatter_grads([nn.Linear(3, 4).weight]), TypeError,
        "(4, 3) is not a partitioned"),
    Row("shards-unsharded", lambda: shards(nn.Linear(3, 4)), TypeError, "(4, 3) is not partitioned"),
    Row("shards-bf16", lambda: shards(partition_module(nn.Linear(3, 4), dtype=torch.bfloat16)), TypeError,
        "parameter 'weight' (4, 3)"),
    # a released parameter used outside the hooks
    Row("forward-released", lambda: _sharded()(torch.randn(2, 3)), RuntimeError,
        "parameter '0.weight' (4, 3) of module '0' (Linear) is not_available"),
    Row("released-in-math", _released_matmul, RuntimeError,
        "parameter '0.weight' (4, 3) of module '0' (Linear) is released"),
    Row("released-in-elementwise", _released_add, RuntimeError,
        "parameter '0.weight' (4, 3) of module '0' (Linear) is released"),
    Row("module-state-dict-released", lambda: _sharded().state_dict(), RuntimeError,
        "parameter '0.weight' (4, 3) of module '0' (Linear) is released"),
    Row("module-load-state-dict-released", lambda: _sharded().load_state_dict(_plain_sd()), RuntimeError,
        "load_full_state_dict"),
    Row("gathered-modifier-rank", lambda: gathered(_sharded().parameters(), modifier_rank=5).__enter__(),
        ValueError, "modifier_rank=5"),
    # load_full_state_dict
    Row("load-missing-key", lambda: load_full_state_dict(_sharded(), _sd(**{"0__weight": None})), RuntimeError,
        "missing keys: ['0.weight']"),
    Row("load-unexpected-key", lambda: load_full_state_dict(_sharded(), _sd(**{"9__weight": torch.zeros(1)})),
        RuntimeError, "unexpected keys: ['9.weight']"),
    Row("load-wrong-shape", lambda: load_full_state_dict(_sharded(), _sd(**{"2__bias": torch.zeros(3)})),
        RuntimeError, "size mismatch for '2.bias': checkpoint (3,), model (2,)"),
    Row("load-wrong-dtype",
        lambda: load_full_state_dict(_sharded(), _sd(**{"2__bias": torch.zeros(2, dtype=torch.int64)})),
        RuntimeError, "dtype mismatch for '2.bias': checkpoint torch.int64, model torch.float32"),
    Row("load-not-a-tensor", lambda: load_full_state_dict(_sharded(), _sd(**{"2__bias": [0.0, 1.0]})),
        RuntimeError, "'2.bias' is a list, expected a tensor"),
    Row("load-not-a-mapping", lambda: load_full_state_dict(_sharded(), [1, 2]), TypeError,
        "sd must be a mapping"),
    Row("load-other-model", lambda: load_full_state_dict(_sharded(), nn.Linear(5, 5).state_dict()),
        RuntimeError, "missing keys: ['0.weight', '0.bias', '2.weight', '2.bias']"),
    Row("full-state-dict-not-module", lambda: full_state_dict([1, 2]), TypeError, "nn.Module"),
    Row("partition-not-module", lambda: partition_module(3), TypeError, "expected an nn.Module, got int"),
    Row("partitioned-dtype-string", lambda: _build_under(dtype="bf16"), TypeError,
        "dtype must be a floating-point torch.dtype or None, got 'bf16'"),
    Row("partition-dtype-integer", lambda: partition_module(_net(), dtype=torch.int32), TypeError,
        "dtype must be a floating-point torch.dtype or None, got torch.int32"),
    # knobs: ShardLayout
    Row("layout-numel-negative", lambda: ShardLayout(-1, 2), ValueError, "numel must be >= 0, got -1"),
    Row("layout-world-zero", lambda: ShardLayout(4, 0), ValueError, "world_size must be >= 1, got 0"),
    Row("layout-align-zero", lambda: ShardLayout(4, 2, 0), ValueError, "align must be >= 1, got 0"),
    Row("layout-numel-float", lambda: ShardLayout(4.0, 2), TypeError, "numel must be an int"),
    Row("layout-rank-outside", lambda: ShardLayout(4, 2).range(2), ValueError, "rank 2 is outside [0, 2)"),
    # checkpoint, ContiguousBuffers, CheckpointPolicy
    Row("checkpoint-buffers-exhausted", _exhausted_buffers, RuntimeError,
        "ContiguousBuffers(num_layers=1) exhausted: checkpoint call 2"),
    Row("buffers-zero", lambda: ContiguousBuffers(0), ValueError, "num_layers must be an int >= 1, got 0"),
    Row("buffers-negative", lambda: ContiguousBuffers(-3), ValueError, "num_layers must be an int >= 1, got -3"),
    Row("policy-offload-not-bool", lambda: CheckpointPolicy(cpu_offload="yes"), TypeError,
        "CheckpointPolicy.cpu_offload must be a bool"),
    Row("policy-buffers-int", lambda: CheckpointPolicy(buffers=3), TypeError,
        "CheckpointPolicy.buffers must be ContiguousBuffers"),
    Row("policy-check-without-group", lambda: CheckpointPolicy(check_replicated=True), ValueError,
        "check_replicated needs a partition_group"),
    Row("checkpoint-not-callable", lambda: checkpoint(3, torch.ones(1)), TypeError, "function must be callable"),
    Row("checkpoint-bad-policy", lambda: checkpoint(abs, torch.ones(1), policy={}), TypeError,
        "policy must be a CheckpointPolicy"),
    # attach and FetchCoordinator knobs
    Row("attach-unsharded", _attach_unsharded, ValueError, "parameter '0.weight' (4, 3) is not sharded"),
    Row("attach-unsharded-offers-partition-module", _attach_unsharded, ValueError, "partition_module"),
    Row("attach-half-sharded", _attach_half_sharded, ValueError, "parameter '1.weight' (2, 4) is not sharded"),
    Row("attach-twice", _attach_twice, RuntimeError, "already has a FetchCoordinator"),
    Row("attach-not-module", lambda: _coordinator_api()[1](3), TypeError, "expected an nn.Module"),
    Row("coordinator-prefetch-negative", _knob(prefetch_bucket_size=-1), ValueError,
        "prefetch_bucket_size must be >= 0"),
    Row("coordinator-reuse-negative", _knob(max_reuse_distance=-5), ValueError, "max_reuse_distance must be >= 0"),
    Row("coordinator-live-negative", _knob(max_live_parameters=-1), ValueError, "max_live_parameters must be >= 0"),
    Row("coordinator-persistence-negative", _knob(persistence_threshold=-1), ValueError,
        "persistence_threshold must be >= 0"),
    Row("coordinator-model-persistence-negative", _knob(model_persistence_threshold=-1), ValueError,
        "model_persistence_threshold must be >= 0"),
    Row("coordinator-reduce-bucket-negative", _knob(reduce_bucket_size=-1), ValueError,
        "reduce_bucket_size must be >= 0"),
    Row("coordinator-knob-float", _knob(prefetch_bucket_size=1e6), TypeError, "prefetch_bucket_size must be an int"),
    Row("coordinator-overlap-not-bool", _knob(overlap_comm="yes"), TypeError, "overlap_comm must be a bool"),
    # BF16Optimizer
    Row("optim-not-optimizer", lambda: _bf16_wrap_list(), TypeError, "torch.optim.Optimizer"),
    Row("optim-not-bf16", lambda: _bf16(*_bf16_params(dtype=torch.float32)), TypeError,
        "parameter 'group0.param0' is torch.float32"),
    Row("optim-mixed-dtype", _opt_mixed_dtype, ValueError, "'group0.param1' is torch.float32"),
    Row("optim-two-devices", _opt_other_device, ValueError, "'group0.param1' is torch.bfloat16 on meta"),
    Row("optim-param-twice-across-groups", _opt_twice, ValueError, "more than one parameter group"),
    Row("optim-param-twice-in-group", _opt_twice_in_group, ValueError, "'group0.param1' appears twice"),
    Row("optim-clip-negative", _opt_knob(clip_grad=-1.0), ValueError, "clip_grad"),
    Row("optim-norm-type-negative", _opt_knob(norm_type=-2.0), ValueError, "norm_type"),
    Row("optim-bucket-zero", _opt_knob(allgather_bucket_size=0), ValueError, "allgather_bucket_size=0"),
    Row("optim-bucket-negative", _opt_knob(allgather_bucket_size=-1), ValueError, "allgather_bucket_size=-1"),
    Row("optim-step-chunk-zero", _opt_knob(step_chunk=0), ValueError, "step_chunk must be >= 1, got 0"),
    Row("optim-grad-accum-dtype", _opt_knob(grad_accum_dtype=torch.int32), ValueError,
        "grad_accum_dtype must be a floating-point torch.dtype"),
    Row("optim-step-before-backward", lambda: _bf16(*_bf16_params()).step(), RuntimeError,
        "before any backward"),
    Row("optim-load-missing-param", lambda: _opt_load({"a": (5,)}, {"a": (5,), "b": (3,)})(), KeyError, "'b'"),
    Row("optim-load-wrong-shape", lambda: _opt_load({"a": (5,)}, {"a": (6,)})(), ValueError, "'a'"),
    Row("optim-load-other-model", lambda: _opt_load({"x": (4,), "y": (2,)}, {"a": (5,)})(), KeyError, "'a'"),
    Row("optim-load-unexpected-param", lambda: _opt_load({"a": (5,), "b": (3,)}, {"a": (5,)})(), ValueError, "'b'"),
    Row("optim-load-wrong-dtype", _opt_load_int_state, ValueError, "int64"),
    Row("scaler-init-scale-zero", lambda: _scaler(init_scale=0), ValueError, "init_scale and min_scale must be > 0"),
    Row("scaler-growth-interval-zero", lambda: _scaler(growth_interval=0), ValueError,
        "growth_interval and hysteresis must be >= 1, got 0"),
    Row("scaler-backoff-above-one", lambda: _scaler(backoff_factor=2.0), ValueError, "0 < backoff_factor <= 1"),
    Row("optim-load-garbage", lambda: _bf16(*_bf16_params()).load_state_dict({"foo": 1}), ValueError,
        "BF16Optimizer.load_state_dict"),
]


def _bf16_wrap_list():
    from parts.optim import BF16Optimizer
    BF16Optimizer([nn.Parameter(torch.ones(2, dtype=torch.bfloat16))])


@pytest.mark.parametrize("row", _params(LOCAL_ROWS))
def test_bad_input_local(row: Row) -> None:
    with pytest.raises(row.exc, match=re.escape(row.fragment)):
        row.fn()


def test_table_ids_are_unique() -> None:
    ids = [r.id for r in LOCAL_ROWS] + [r.id for r in RANK_ROWS]
    assert len(ids) == len(set(ids))


# ---------------------------------------------------------------- rows that need ranks
def _on_rank1_outside(call):
    """Make a group of rank 0 only (every rank must take part) and let rank 1 ``call(group)``."""
    group, own = dist.new_group(ranks=[0]), dist.new_group(ranks=[1])
    if dist.get_rank() == 1:
        call(group, own)


def _nonmember_build(build):
    """Rank 1 builds over a group of rank 0 only, rank 0 over that group: rank 0's build names no
    other rank, so it builds while rank 1 raises."""
    group = dist.new_group(ranks=[0])
    build(group)


def _nonmember_partition_module():
    _nonmember_build(lambda group: partition_module(nn.Linear(2, 2), group=group))


def _nonmember_partitioned():
    _nonmember_build(lambda group: _build_under(group=group))


def _nonmember_checkpoint():
    def call(group, own):
        lin = nn.Linear(3, 3)
        x = lin(torch.randn(2, 3, requires_grad=True))
        checkpoint(lin, x, policy=CheckpointPolicy(partition_group=group)).sum().backward()
    _on_rank1_outside(call)


def _nonmember_coordinator():
    def call(group, own):
        FetchCoordinator, attach = _coordinator_api()
        model = partition_module(_net(), group=own)
        attach(model, FetchCoordinator(group=group))
        model(torch.randn(2, 3)).sum().backward()
    group, own = dist.new_group(ranks=[0]), dist.new_group(ranks=[1])
    if dist.get_rank() == 0:
        partition_module(_net(), group=group)  # every rank takes part in each build's layout agreement
    else:
        call(group, own)


def _nonmember_optimizer():
    _on_rank1_outside(lambda group, own: _bf16(*_bf16_params(), group=group))


def _gather_other_group():
    model = partition_module(_net())
    gather(model.parameters(), group=dist.new_group(ranks=[0, 1]))


def _load_missing_on_rank0():
    sd = _sd(**{"0__weight": None}) if dist.get_rank() == 0 else {}
    load_full_state_dict(partition_module(_net()), sd)


def _load_wrong_shape_on_rank0():
    sd = _sd(**{"2__weight": torch.zeros(2, 5)}) if dist.get_rank() == 0 else {}
    load_full_state_dict(partition_module(_net()), sd)


def _modifier_rank_outside():
    with gathered(partition_module(_net()).parameters(), modifier_rank=2):
        pass


RANK_ROWS = [
    # (the group has rank 0 only; rank 1 is the one not in it)
    Row("group-without-rank-partition-module", _nonmember_partition_module, ValueError, "rank 1", ranks=(1,)),
    Row("group-without-rank-partitioned", _nonmember_partitioned, ValueError, "rank 1", ranks=(1,)),
    Row("group-without-rank-checkpoint", _nonmember_checkpoint, ValueError, "rank 1", ranks=(1,)),
    Row("group-without-rank-coordinator", _nonmember_coordinator, ValueError, "rank 1", ranks=(1,)),
    Row("group-without-rank-optimizer", _nonmember_optimizer, ValueError, "rank 1", ranks=(1,)),
    Row("gather-with-other-group", _gather_other_group, ValueError, "sharded over another process group"),
    Row("load-missing-key-rank0", _load_missing_on_rank0, RuntimeError, "missing keys: ['0.weight']"),
    Row("load-wrong-shape-rank0", _load_wrong_shape_on_rank0, RuntimeError,
        "size mismatch for '2.weight': checkpoint (2, 5), model (2, 4)"),
    Row("modifier-rank-outside-group", _modifier_rank_outside, ValueError, "modifier_rank=2 is outside the group of 2"),
]


def body_rank_row(row_id: str):
    """Run one rank row on this rank; return (exception type name, message) or None."""
    row = next(r for r in RANK_ROWS if r.id == row_id)
    try:
        row.fn()
    except Exception as error:  # noqa: BLE001 - the parent checks type and message
        return type(error).__name__, isinstance(error, row.exc), str(error)
    return None


@pytest.mark.parametrize("row", _params(RANK_ROWS))
def test_bad_input_ranks(row: Row) -> None:
    results = run(2, body_rank_row, row.id, timeout=30)
    for rank, result in enumerate(results):
        if rank not in row.ranks and row.others is type(None):
            assert result is None, f"rank {rank} raised for {row.id}: {result}"
            continue
        if rank not in row.ranks:
            assert result is not None and result[0] == row.others.__name__, f"rank {rank}: {result}"
            assert row.fragment in result[2], f"rank {rank}: {result}"
            continue
        assert result is not None, f"rank {rank} did not raise for {row.id}"
        name, is_expected, message = result
        assert is_expected, f"rank {rank}: {name}: {message}"
        assert row.fragment in message, f"rank {rank}: {name}: {message}"
