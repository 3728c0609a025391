"""torch.compile on an attached model (issue 20): ``compile_blocks`` compiles each block's
forward with inductor into one graph, the coordinator's hooks run outside it. World 2,
against the eager parts run and plain PyTorch on the whole batch."""

import warnings

import torch

from harness import run
from parts._compat import counting_backend, dynamo_counters
from parts.partition import attach, compile_blocks, shards
from test_coordinator_models import GPT, batch, full_params, make_pair, rank_info

STEPS, PER_RANK, LAYERS = 3, 2, 2


def _train(model, compiled: bool) -> tuple:
    rank, world = rank_info()
    attach(model, persistence_threshold=0)  # every parameter fetched and released per block
    backend, calls = counting_backend("inductor")
    if compiled:
        compile_blocks(model, model.blocks, backend=backend)
    opt = torch.optim.SGD(shards(model), lr=0.1)
    losses = []
    for step in range(STEPS):
        loss = model(*batch(step, PER_RANK, rank * PER_RANK))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append((mean / world).item())
    return losses, full_params(model), calls[0]


def _compile_case() -> dict:
    with warnings.catch_warnings():  # torch's own warnings while compiling (not ours)
        warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.")
        return _compile_case_body()


def _compile_case_body() -> dict:
    torch.compiler.reset()
    ref, eager = make_pair(GPT, layers=LAYERS)
    _, model = make_pair(GPT, layers=LAYERS)
    ref_opt, ref_losses = torch.optim.SGD(ref.parameters(), lr=0.1), []
    for step in range(STEPS):
        loss = ref(*batch(step, PER_RANK * rank_info()[1]))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    eager_losses, eager_params, _ = _train(eager, compiled=False)
    losses, params, calls = _train(model, compiled=True)
    return dict(ref=ref_losses, eager=eager_losses, compiled=losses, calls=calls,
                ref_params=[p.detach() for p in ref.parameters()], eager_params=eager_params,
                params=params, counters=dynamo_counters())


def test_compiled_blocks_one_graph_each_and_match_eager():
    # inductor fuses and reorders fp32 math (layer norm, gelu, softmax): losses and params agree
    # with the eager parts run and plain PyTorch to 1e-5, not bitwise
    for out in run(2, _compile_case, timeout=900):
        c = out["counters"]
        assert c["graph_breaks"] == 0, c["break_reasons"]
        assert c["frames"] == 1 and c["graphs"] == 1  # the blocks share one compiled graph
        assert out["calls"] == STEPS * LAYERS  # every block call ran the compiled graph
        torch.testing.assert_close(out["compiled"], out["eager"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["compiled"], out["ref"], rtol=1e-5, atol=1e-5)
        for got, eager, ref in zip(out["params"], out["eager_params"], out["ref_params"]):
            torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
