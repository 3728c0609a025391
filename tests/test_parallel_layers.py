"""Tensor-parallel layers and the TP GPT equal their non-parallel counterparts (world 2 and 4).

Tolerance: a row-parallel layer sums partial products over tp ranks, and a narrower matmul
blocks its dot products differently (CPU kernels), so fp32 outputs and grads agree to rounding:
rtol 1e-5, atol 1e-6. Weights and biases (sliced, not computed) are compared with torch.equal.
"""

import os
import sys

import pytest
import torch
import torch.distributed as dist

from harness import RankFailure, run
from parts.checkpoint import seed_model_parallel
from parts.parallel import (ColumnParallelLinear, ParallelGrid, RowParallelLinear, grad_norm_2d,
                            mark_tp_split, shard_tensor, tp_split, unshard_tensor)
from parts.parallel._collectives import all_gather_tp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recipes"))
from gpt_model import GPT, GPTConfig  # noqa: E402
from gpt_tp_model import TPGPT, init_state_dict  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)
CFG = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _full(t, p, group):
    """The full tensor of ``t`` (a piece shaped like parameter ``p``) from every tp rank."""
    split = tp_split(p)
    return unshard_tensor(all_gather_tp(t, group), *split) if split else t


def _column_body(chunks):
    group, rank, tp = None, dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = torch.nn.Linear(12, 6 * tp * chunks)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(12, 6 * tp * chunks, group, chunks=chunks)
    x = torch.randn(3, 5, 12, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = layer(x), ref(x_ref)
    weight = torch.randn_like(y_ref)  # loss = sum(y * weight): a non-trivial upstream grad
    (y * shard_tensor(weight, 2, tp, rank, chunks)).sum().backward()
    (y_ref * weight).sum().backward()
    return dict(weight_equal=torch.equal(layer.weight, shard_tensor(ref.weight.detach(), 0, tp, rank, chunks)),
                bias_equal=torch.equal(layer.bias, shard_tensor(ref.bias.detach(), 0, tp, rank, chunks)),
                y=(unshard_tensor(all_gather_tp(y, group), 2, chunks), y_ref.detach()),
                x_grad=(x.grad, x_ref.grad),
                w_grad=(layer.weight.grad, shard_tensor(ref.weight.grad, 0, tp, rank, chunks)),
                b_grad=(layer.bias.grad, shard_tensor(ref.bias.grad, 0, tp, rank, chunks)))


@pytest.mark.parametrize("world,chunks", [(2, 1), (2, 3), (4, 3)])
def test_column_parallel_equals_linear(world, chunks):
    for r in run(world, _column_body, chunks):
        assert r["weight_equal"] and r["bias_equal"]
        torch.testing.assert_close(*r["y"], **TOL)  # a narrower matmul blocks the dot products differently
        torch.testing.assert_close(*r["x_grad"], **TOL)  # summed over tp ranks in backward
        torch.testing.assert_close(*r["w_grad"], **TOL)
        torch.testing.assert_close(*r["b_grad"], **TOL)


def _row_body():
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = torch.nn.Linear(8 * tp, 7)
    torch.manual_seed(0)
    layer = RowParallelLinear(8 * tp, 7)
    x_full = torch.randn(3, 5, 8 * tp, generator=torch.Generator().manual_seed(1))
    x = shard_tensor(x_full, 2, tp, rank).requires_grad_()
    x_ref = x_full.clone().requires_grad_()
    y, y_ref = layer(x), ref(x_ref)
    weight = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(2))
    (y * weight).sum().backward()
    (y_ref * weight).sum().backward()
    return dict(weight_equal=torch.equal(layer.weight, shard_tensor(ref.weight.detach(), 1, tp, rank)),
                bias_equal=torch.equal(layer.bias, ref.bias), y=(y.detach(), y_ref.detach()),
                x_grad=(x.grad, shard_tensor(x_ref.grad, 2, tp, rank)),
                w_grad=(layer.weight.grad, shard_tensor(ref.weight.grad, 1, tp, rank)),
                b_grad=(layer.bias.grad, ref.bias.grad))


@pytest.mark.parametrize("world", [2, 4])
def test_row_parallel_equals_linear(world):
    results = run(world, _row_body)
    for r in results:
        assert r["weight_equal"] and r["bias_equal"]
        torch.testing.assert_close(*r["y"], **TOL)  # partial sums added across ranks
        assert torch.equal(r["y"][0], results[0]["y"][0])  # the all-reduce leaves one value everywhere
        torch.testing.assert_close(*r["x_grad"], **TOL)
        torch.testing.assert_close(*r["w_grad"], **TOL)
        torch.testing.assert_close(*r["b_grad"], **TOL)


def _gpt_body(tp):
    grid = ParallelGrid(tp)
    ref = GPT(CFG)
    ref.load_state_dict(init_state_dict(CFG, seed=3))
    model = TPGPT(CFG, grid.tp_group, seed=3)
    gen = torch.Generator().manual_seed(10 + grid.dp_rank)
    idx, tgt = (torch.randint(0, 128, (2, 16), generator=gen) for _ in range(2))
    loss_ref, loss = ref(idx, tgt), model(idx, tgt)
    loss_ref.backward()
    loss.backward()
    ref_params = dict(ref.named_parameters())
    out = {"loss": (loss.detach(), loss_ref.detach()), "weights_equal": [], "grads": []}
    for name, p in model.named_parameters():
        out["weights_equal"].append(torch.equal(_full(p.detach(), p, grid.tp_group), ref_params[name]))
        out["grads"].append((name, _full(p.grad, p, grid.tp_group), ref_params[name].grad))
    return out


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 4), (4, 2)])
def test_tp_gpt_equals_gpt(world, tp):
    for r in run(world, _gpt_body, tp):
        assert all(r["weights_equal"]) and len(r["weights_equal"]) == len(dict(GPT(CFG).named_parameters()))
        torch.testing.assert_close(*r["loss"], **TOL)
        for name, grad, grad_ref in r["grads"]:
            torch.testing.assert_close(grad, grad_ref, **TOL, msg=lambda m: f"{name}: {m}")


def _dropout_body():
    grid = ParallelGrid(2)
    cfg = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.3)
    torch.manual_seed(5)  # the default stream: shared by every rank
    tracker = seed_model_parallel(5, grid.tp_group)
    model = TPGPT(cfg, grid.tp_group, tracker=tracker, seed=3)
    before = tracker.get_states()["model-parallel-rng"]
    idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = model(idx)
    after = tracker.get_states()["model-parallel-rng"]
    return logits.detach(), torch.get_rng_state(), after, torch.equal(before, after)


def test_dropout_streams_inside_and_outside_the_tp_region():
    (l0, cpu0, tr0, same0), (l1, cpu1, tr1, same1) = run(2, _dropout_body)
    assert not same0 and not same1  # attention dropout drew from the tracker stream
    assert not torch.equal(tr0, tr1)  # ... which differs per tp rank
    assert torch.equal(cpu0, cpu1)  # residual dropout drew the same default stream on both ranks
    assert torch.equal(l0, l1)  # so activations (and logits) stay replicated across the tp group


def _bad_split_body():
    ColumnParallelLinear(4, 6, chunks=2)  # 6 outputs in 2 chunks over 4 ranks


def test_uneven_split_names_the_layer():
    with pytest.raises(RankFailure, match=r"ColumnParallelLinear\(4, 6\): a dimension of size 6"):
        run(4, _bad_split_body)


def _norm_body(norm_type, dp_replicated):
    """A tp-split weight and a tp-replicated bias whose grads are known in full on every rank."""
    grid = ParallelGrid(2)
    gen = torch.Generator().manual_seed(7)
    full_w, full_b = torch.randn(4, 6, generator=gen), torch.randn(5, generator=gen)
    w = torch.nn.Parameter(torch.zeros(4, 3))
    mark_tp_split(w, 1)
    b = torch.nn.Parameter(torch.zeros(5))
    grads = {id(w): shard_tensor(full_w, 1, 2, grid.tp_rank).reshape(-1), id(b): full_b}
    if not dp_replicated:  # ZeRO: each dp rank holds a disjoint part of every grad
        grads = {k: g.tensor_split(2)[grid.dp_rank] for k, g in grads.items()}
    norm = grad_norm_2d([w, b], grid, grad_fn=lambda p: grads[id(p)], norm_type=norm_type,
                        dp_replicated=dp_replicated)
    return norm, torch.linalg.vector_norm(torch.cat([full_w.reshape(-1), full_b]), norm_type)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("dp_replicated", [False, True])
def test_grid_norm_counts_every_element_once(norm_type, dp_replicated):
    for norm, expected in run(4, _norm_body, norm_type, dp_replicated):
        torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)  # sums in another order
