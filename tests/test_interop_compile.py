"""torch.compile on an attached model, world 2: ``compile_blocks`` compiles each block's forward
into one graph with the coordinator's hooks outside it; ``torch.compile(model)`` and
``model.compile()`` run the hooks eagerly as graph breaks and compile the regions between them
(one per fetch unit). Against the eager parts run and plain PyTorch on the whole batch."""

import warnings

import pytest
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


def _fresh_dynamo() -> None:
    """An empty dynamo cache and zero counters (the workers live for the whole session)."""
    from torch._dynamo.utils import counters
    torch.compiler.reset()
    counters.clear()


def _compile_case_body() -> dict:
    _fresh_dynamo()
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


@pytest.mark.slow
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


# ------------------------------------------------------- torch.compile(model), model.compile()
HF_VOCAB, HF_SEQ = 97, 16


def _hf_model(kind: str) -> torch.nn.Module:
    """A tiny sharded Llama or GPT-2 (dropout 0: inductor draws other random numbers than eager)."""
    import transformers
    from parts.partition import partition_module
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=LAYERS, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=32)
        return partition_module(transformers.LlamaForCausalLM(config))
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=32, n_head=2, vocab_size=HF_VOCAB,
                                     n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return partition_module(transformers.GPT2LMHeadModel(config))


def _compiled(model: torch.nn.Module, how: str, backend) -> torch.nn.Module:
    """What the user calls: the model, ``torch.compile(model)`` or the model after ``model.compile()``."""
    if how == "torch.compile":
        return torch.compile(model, backend=backend)
    if how == "model.compile":
        model.compile(backend=backend)
    return model


def _train_hf(kind: str, how: str, knobs: dict) -> tuple:
    """AdamW steps of an attached tiny HF model on this rank's rows: losses, full weights, graph calls."""
    from parts.partition import full_state_dict
    rank, world = rank_info()
    model = _hf_model(kind)
    attach(model, **knobs)
    backend, calls = counting_backend("aot_eager")
    run_model = _compiled(model, how, backend)
    opt, losses = torch.optim.AdamW(shards(model), lr=1e-2), []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, HF_VOCAB, (PER_RANK * world, HF_SEQ), generator=g)[rank * PER_RANK:][:PER_RANK]
        loss = run_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, full_state_dict(model, rank0_only=False), calls[0]


def _quiet(fn, *args):
    """``fn(*args)`` with a fresh dynamo cache and torch's own warnings while compiling ignored."""
    _fresh_dynamo()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.")
        return fn(*args)


def _whole_model_case(kind: str, hows: list, knobs: dict) -> dict:
    return {how: _quiet(_train_hf, kind, how, knobs) for how in ["eager", *hows]}


def _assert_matches_eager(out: dict, hows: list) -> None:
    eager_losses, eager_state, _ = out["eager"]
    for how in hows:
        losses, state, calls = out[how]
        assert calls >= STEPS * LAYERS, (how, calls)  # at least every decoder layer ran compiled
        torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-5)
        assert state.keys() == eager_state.keys()
        for key in state:
            torch.testing.assert_close(state[key], eager_state[key], rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.slow
def test_torch_compile_and_module_compile_of_attached_llama_match_eager():
    # default knobs (every weight of the tiny model persistent): the coordinator's hooks run
    # eagerly, each fetch unit's forward and backward compiled with aot_eager (eager's kernels)
    pytest.importorskip("transformers")
    hows = ["torch.compile", "model.compile"]
    for out in run(2, _whole_model_case, "llama", hows, {}, timeout=900):
        _assert_matches_eager(out, hows)


@pytest.mark.slow
def test_torch_compile_of_attached_gpt2_with_mixed_precision_matches_eager():
    # tied lm_head, bf16 compute from fp32 shards
    pytest.importorskip("transformers")
    from parts.partition import MixedPrecision
    knobs = dict(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    for out in run(2, _whole_model_case, "gpt2", ["torch.compile"], knobs, timeout=900):
        _assert_matches_eager(out, ["torch.compile"])


def _inductor_case() -> dict:
    ref, eager = make_pair(GPT, layers=LAYERS)
    _, model = make_pair(GPT, layers=LAYERS)
    ref_losses = []
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(STEPS):
        loss = ref(*batch(step, PER_RANK * rank_info()[1]))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    rank = rank_info()[0]
    out = dict(ref=ref_losses, ref_params=[p.detach() for p in ref.parameters()])
    for name, m in (("eager", eager), ("compiled", model)):
        attach(m, persistence_threshold=0)  # every parameter fetched per unit and released after it
        backend, calls = counting_backend("inductor")
        run_model = torch.compile(m, backend=backend) if name == "compiled" else m
        opt, losses = torch.optim.SGD(shards(m), lr=0.1), []
        for step in range(STEPS):
            loss = run_model(*batch(step, PER_RANK, rank * PER_RANK))
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append((mean / rank_info()[1]).item())
        out[name], out[name + "_params"], out[name + "_calls"] = losses, full_params(m), calls[0]
    out["break_reasons"] = dynamo_counters()["break_reasons"]
    return out


def test_torch_compile_inductor_of_attached_gpt_with_released_params_matches_eager_and_torch():
    # the tied output projection reads wte.weight outside its module (fetched by the coordinator
    # in a graph break); saved parameters are released after forward and gathered back into the
    # same storage for the compiled backward. Inductor reorders fp32 math: 1e-5, not bitwise
    for out in run(2, _quiet, _inductor_case, timeout=900):
        assert out["compiled_calls"] >= STEPS * LAYERS
        # a block's reads of its own (watched) parameters stay inside its graph
        assert not [r for r in out["break_reasons"] if "_on_param_read" in r], out["break_reasons"]
        torch.testing.assert_close(out["compiled"], out["eager"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["compiled"], out["ref"], rtol=1e-5, atol=1e-5)
        for got, eager, ref in zip(out["compiled_params"], out["eager_params"], out["ref_params"]):
            torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def _fullgraph_case() -> dict:
    _, model = make_pair(GPT, layers=LAYERS)
    attach(model)
    rows = batch(0, PER_RANK, rank_info()[0] * PER_RANK)
    try:
        torch.compile(model, backend="aot_eager", fullgraph=True)(*rows)
        error = None
    except Exception as err:  # dynamo's Unsupported, carrying the coordinator's reason
        error = str(err)
    loss = model(*rows)  # nothing ran: the model still trains eagerly
    loss.backward()
    return dict(error=error, loss=loss.item())


def test_fullgraph_compile_of_attached_model_raises_naming_compile_blocks():
    for out in run(2, _quiet, _fullgraph_case, timeout=900):
        assert out["error"] is not None
        assert "fullgraph=True cannot hold them" in out["error"]
        assert "compile_blocks(model, blocks, fullgraph=True)" in out["error"]
        assert out["loss"] > 0
