"""Fetch coordinator on real-model patterns: eval, multi-forward, checkpointing, structured
outputs, external parameters, dynamic graphs, debug mode, validation, detach."""

import copy

import pytest
import torch
from harness import RankFailure, run
from hidden_weight import Hidden
from torch import nn

from parts.partition import gathered, meta, partition_module, shards
from parts.partition.coordinator import (FetchCoordinator, attach, detach,
                                         register_external_parameter)
from test_coordinator_models import (DIM, GPT, Structured, batch, full_params, make_pair,
                                     rank_info, train_reference, train_sharded)

PER_RANK = 2


def _close(a, b):
    # different fp32 summation order across ranks (see test_coordinator.py): 1e-5 relative
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------ eval phase
def _eval_and_train() -> dict:
    rank, world = rank_info()
    ref, model = make_pair(GPT)
    co = attach(model, persistence_threshold=0)
    opt = torch.optim.AdamW(shards(model), lr=1e-2)
    outcomes, evals = [], []
    for step in range(3):
        model.train()
        model(*batch(step, PER_RANK, rank * PER_RANK)).backward()
        opt.step()
        opt.zero_grad()
        outcomes.append((co.stats().phase, co.stats().trace_outcome))
        model.eval()
        with torch.no_grad():
            evals.append(model(*batch(50, PER_RANK, rank * PER_RANK)))
        outcomes.append((co.stats().phase, co.stats().trace_outcome))
    co.detach()
    with torch.no_grad(), gathered(list(model.parameters())):
        plain = model(*batch(50, PER_RANK, rank * PER_RANK))
    return dict(outcomes=outcomes, misses=co.stats().trace_misses, last_eval=evals[-1], plain=plain)


def test_eval_has_its_own_trace_and_train_keeps_replaying():
    out = run(2, _eval_and_train, timeout=120)[0]
    assert out["outcomes"] == [("train", "recorded"), ("eval/no_grad", "recorded"),
                               ("train", "replayed"), ("eval/no_grad", "replayed"),
                               ("train", "replayed"), ("eval/no_grad", "replayed")]
    assert out["misses"] == 0
    assert torch.equal(out["last_eval"], out["plain"])  # same math as with all params gathered


# --------------------------------------------------------- several forwards, one backward
def _multi_forward() -> tuple:
    rank, world = rank_info()
    ref, model = make_pair(GPT)
    attach(model, persistence_threshold=0)
    grads = []
    for m in (ref, model):
        for step in range(2):
            a = batch(2 * step, PER_RANK, rank * PER_RANK)
            b = batch(2 * step + 1, PER_RANK, rank * PER_RANK)
            (m(*a) + 0.5 * m(*b)).backward()
    for p in model.parameters():
        grads.append(meta(p).grad_shard.clone())
    # reference: DDP-style average over ranks of the full grads, then this rank's slice
    ref_grads = []
    for p, q in zip(ref.parameters(), model.parameters()):
        g = p.grad.detach().reshape(-1).clone()
        torch.distributed.all_reduce(g)
        g /= world
        start, stop = meta(q).layout.range(rank)
        ref_grads.append(g[start:stop])
    return grads, ref_grads


def test_several_forwards_before_one_backward_accumulate_correctly():
    for grads, ref_grads in run(2, _multi_forward, timeout=120):
        for g, r in zip(grads, ref_grads):
            _close(g[:r.numel()], r)
            assert torch.count_nonzero(g[r.numel():]) == 0  # padding stays zero


# ---------------------------------------------------------------- activation checkpointing
def _checkpointed(steps: int, ckpt: object = True) -> tuple:
    rank, world = rank_info()
    ref, model = make_pair(GPT, ckpt=ckpt)
    ref_losses = train_reference(ref, steps, PER_RANK * world)
    # leaf fetch units: with a block as one unit, a non-reentrant recompute finds the block
    # gathered by the block's own backward fetch (nothing to fetch again)
    losses, co = train_sharded(model, steps, PER_RANK, max_reuse_distance=0,
                              persistence_threshold=0, fetch_unit_size=0)
    return ref_losses, losses, [p.detach() for p in ref.parameters()], full_params(model), co.stats()


@pytest.mark.parametrize("ckpt", [True, "reentrant"])
def test_activation_checkpointing_recompute_fetches_again(ckpt):
    for ref_losses, losses, ref_params, got, stats in run(2, _checkpointed, 4, ckpt, timeout=120):
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        for a, b in zip(ref_params, got):
            _close(b, a)
        # with reuse off, the recompute in backward gathers the block params once more
        assert stats.regathered_params > 0 and stats.trace_outcome == "replayed"


# ------------------------------------------------------------------- structured outputs
def _structured() -> tuple:
    rank, world = rank_info()
    torch.manual_seed(0)
    ref = Structured()
    model = partition_module(copy.deepcopy(ref))
    attach(model, persistence_threshold=0)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4 * world, DIM, generator=g)
    ref(x).backward()
    model(x[rank * 4:(rank + 1) * 4]).backward()
    out = []
    for p, q in zip(ref.parameters(), model.parameters()):
        start, stop = meta(q).layout.range(rank)
        out.append((meta(q).grad_shard[:stop - start].clone(), p.grad.reshape(-1)[start:stop].clone()))
    return out


def test_dict_and_dataclass_outputs_get_backward_fetches():
    for pairs in run(2, _structured, timeout=60):
        for got, want in pairs:
            _close(got, want)


# ------------------------------------------------------------------ external parameters
class TwoPart(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = Hidden(self.a)

    def forward(self, x):
        return self.b(self.a(x)).pow(2).mean()


def _external(register: bool) -> tuple:
    rank, world = rank_info()
    torch.manual_seed(0)
    ref = TwoPart()
    model = partition_module(copy.deepcopy(ref))
    model.b.__dict__["refs"] = [model.a.weight]
    attach(model, persistence_threshold=0)
    if register:
        register_external_parameter(model.b, model.a.weight)
    x = torch.randn(2 * world, DIM, generator=torch.Generator().manual_seed(3))
    ref(x).backward()
    model(x[rank * 2:(rank + 1) * 2]).backward()
    w = model.a.weight
    start, stop = meta(w).layout.range(rank)
    return meta(w).grad_shard[:stop - start].clone(), ref.a.weight.grad.reshape(-1)[start:stop].clone()


def test_register_external_parameter_for_undetectable_uses():
    for got, want in run(2, _external, True, timeout=60):
        _close(got, want)
    with pytest.raises(RankFailure, match="RuntimeError"):  # unregistered: a released weight is used
        run(2, _external, False, timeout=60)


# ------------------------------------------------------------------------ dynamic graphs
def _dynamic(steps: int) -> tuple:
    rank, world = rank_info()
    ref, model = make_pair(GPT, skip_odd=True)
    ref_losses = train_reference(ref, steps, PER_RANK * world)
    outcomes = []
    losses, co = [], None
    co = attach(model, persistence_threshold=0)
    opt = torch.optim.AdamW(shards(model), lr=1e-2)
    for step in range(steps):
        loss = model(*batch(step, PER_RANK, rank * PER_RANK))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append((mean / world).item())
        outcomes.append(co.stats().trace_outcome)
    return ref_losses, losses, [p.detach() for p in ref.parameters()], full_params(model), outcomes


def test_skipping_a_block_on_odd_steps_matches_reference():
    for ref_losses, losses, ref_params, got, outcomes in run(2, _dynamic, 6, timeout=120):
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        for a, b in zip(ref_params, got):
            _close(b, a)
        # one trace per shape of the graph: after one divergence both are known and replayed
        assert outcomes == ["recorded", "diverged", "replayed", "replayed", "replayed", "replayed"]


# ---------------------------------------------------------------------------- debug mode
def _diverging_ranks(**knobs) -> None:
    rank, world = rank_info()
    _, model = make_pair(GPT)
    attach(model, debug=True, **knobs)
    model.calls = rank  # rank 1 skips block 1 ("odd call"), rank 0 runs it
    model.skip_odd = True
    model(*batch(0, PER_RANK, rank * PER_RANK)).backward()


def _agreeing_ranks() -> str:
    rank, world = rank_info()
    _, model = make_pair(GPT)
    co = attach(model, debug=True)
    for step in range(2):
        model(*batch(step, PER_RANK, rank * PER_RANK)).backward()
    return co.stats().trace_digest


def test_debug_mode_names_the_first_divergent_module():
    digests = run(2, _agreeing_ranks, timeout=60)
    assert digests[0] == digests[1]
    with pytest.raises(RankFailure, match="RankDivergence") as info:
        run(2, _diverging_ranks, timeout=60, persistence_threshold=0)
    assert "blocks.1" in str(info.value) and "blocks.2" in str(info.value)
    # all persistent (defaults): the blocks fetch nothing, and rank 1 reduces zeros for the grads of
    # the block it skipped (uneven.py): the ranks' collectives are the same, nothing to name
    run(2, _diverging_ranks, timeout=60)


SMALL = dict(persistence_threshold=600, prefetch_bucket_size=3000, reduce_bucket_size=0)


def _debug_matches_normal(knobs: dict) -> tuple:
    runs = []
    for debug in (False, True):
        _, model = make_pair(GPT)
        losses, co = train_sharded(model, 3, PER_RANK, debug=debug, **knobs)
        model.eval()
        with torch.no_grad():  # an eval step in between: its own phase, agreed on by both ranks
            model(*batch(9, PER_RANK, 0))
        model.train()
        model(*batch(3, PER_RANK, 0)).backward()
        runs.append((losses, [s.detach().clone() for s in shards(model)], co.stats().trace_digest))
    return runs


@pytest.mark.parametrize("knobs", [{}, SMALL], ids=["defaults", "small-buckets"])
def test_debug_mode_agrees_and_changes_nothing(knobs):
    """Agreeing ranks pass every check (refresh after optimizer steps, prefetch, per-param
    reduce-scatter, an eval step) and get bit-identical results with and without debug."""
    for normal, debug in run(2, _debug_matches_normal, knobs, timeout=90):
        assert normal[0] == debug[0] and normal[2] == debug[2]
        assert all(torch.equal(a, b) for a, b in zip(normal[1], debug[1]))


def _knobs_differ(knob: str) -> str:
    """Rank 1 runs with another knob value, its collectives differing from rank 0's mid-step.
    ``attach`` refuses ranks whose knobs differ (tests/test_world3_failures.py), so its
    comparison is switched off here: what debug mode catches is collectives that diverge."""
    from unittest import mock

    import parts.partition.coordinator.checks as checks
    from parts.partition import RankDivergence
    rank, world = rank_info()
    _, model = make_pair(GPT)
    with mock.patch.object(checks, "_compare", lambda every: None):
        attach(model, debug=True, persistence_threshold=0, **({knob: 0} if rank == 1 else {}))
    try:
        for step in range(2):
            model(*batch(step, PER_RANK, rank * PER_RANK)).backward()
    except RankDivergence as error:
        return str(error)
    return ""


@pytest.mark.parametrize("knob, fragments", [
    # step 1 replays the trace: rank 0 prefetches after the root's fetch, rank 1 (no prefetch)
    # goes on to fetch the next module
    ("prefetch_bucket_size", ["ranks diverged at event 2: rank 0 is at a prefetch of",
                              "rank 1 is at the forward of module 'wte' (event 2 of train step 1)"]),
    # rank 1 reduce-scatters every grad as soon as it is complete, rank 0 buckets them
    ("reduce_bucket_size", ["rank 1 is at a reduce-scatter of 1 gradients (event", "of train step 0)",
                            "rank 0 is at the backward of module"]),
])
def test_debug_mode_catches_divergent_prefetch_and_reduce(knob, fragments):
    messages = run(2, _knobs_differ, knob, timeout=60)
    assert messages[0] == messages[1]
    for fragment in fragments:
        assert fragment in messages[0], messages[0]


# ---------------------------------------------------------------- validation and detach
def test_knobs_and_unsharded_models_are_rejected():
    with pytest.raises(ValueError, match="max_live_parameters"):
        FetchCoordinator(max_live_parameters=-1)
    with pytest.raises(ValueError, match="prefetch_bucket_size"):
        attach(nn.Linear(2, 2), prefetch_bucket_size=-5)
    with pytest.raises(ValueError, match="partition_module"):
        attach(nn.Linear(2, 2))


def _detach() -> tuple:
    rank, world = rank_info()
    _, model = make_pair(GPT)
    co = attach(model)
    x = batch(0, PER_RANK, rank * PER_RANK)
    before = model(*x).detach()
    model.zero_grad()
    detach(model)
    released = all(meta(p).status.value == "not_available" for p in model.parameters())
    try:
        model(*x)
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    with gathered(list(model.parameters())):
        again = model(*x).detach()
    co2 = attach(model)
    return before, again, released, error, co2 is not co


def test_detach_leaves_sharded_usable_params():
    for before, again, released, error, new in run(2, _detach, timeout=60):
        assert torch.equal(before, again) and released and new
        assert "not_available" in error


# ------------------------------------------- a module run twice, frozen params, unfreezing
class Twice(nn.Module):
    """One block applied twice in a forward (its params are in use twice), a frozen embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, DIM)
        self.lin, self.out = nn.Linear(DIM, DIM), nn.Linear(DIM, 1)

    def forward(self, idx):
        x = self.emb(idx)
        x = torch.tanh(self.lin(x))
        x = torch.tanh(self.lin(x))
        return self.out(x).pow(2).mean()


def _twice(steps: int, threshold: int) -> tuple:
    rank, world = rank_info()
    torch.manual_seed(0)
    ref = Twice()
    model = partition_module(copy.deepcopy(ref))
    for m in (ref, model):
        m.emb.weight.requires_grad_(False)
    co = attach(model, persistence_threshold=threshold, max_reuse_distance=0)
    opts = [torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2),
            torch.optim.AdamW(shards(model), lr=1e-2)]
    idx = torch.randint(0, 11, (2 * world, 5), generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        if step == steps - 1:  # unfrozen after attach: its grad is reduced from the next backward on
            ref.emb.weight.requires_grad_(True)
            model.emb.weight.requires_grad_(True)
        for m, x, opt in ((ref, idx, opts[0]), (model, idx[2 * rank:2 * rank + 2], opts[1])):
            m(x).backward()
        if step < steps - 1:
            for opt in opts:
                opt.step()
                opt.zero_grad()
    emb_grad = meta(model.emb.weight).grad_shard
    start, stop = meta(model.emb.weight).layout.range(rank)
    return ([p.detach() for p in ref.parameters()], full_params(model), co.stats(),
            emb_grad[:stop - start].clone(), ref.emb.weight.grad.reshape(-1)[start:stop].clone())


@pytest.mark.parametrize("threshold", [0, 100_000])
def test_module_run_twice_frozen_and_late_unfrozen_params(threshold):
    # threshold 0: every param gathered per use; the default: all persistent, grads in one flat
    # reduce-scatter that the frozen embedding joins once it is unfrozen
    for ref_params, got, stats, emb_grad, ref_emb_grad in run(2, _twice, 3, threshold, timeout=60):
        for a, b in zip(ref_params, got):
            _close(b, a)
        _close(emb_grad, ref_emb_grad)
        # the embedding's backward fetch appears once it is unfrozen: one divergence, re-recorded
        # (persistent, it has no fetch to trace)
        misses = 1 if threshold == 0 else 0
        assert stats.trace_outcome == ("diverged" if misses else "replayed") and stats.trace_misses == misses


def _error_then_train() -> tuple:
    rank, world = rank_info()
    ref, model = make_pair(GPT)
    co = attach(model, persistence_threshold=0)
    idx, tgt = batch(0, PER_RANK, rank * PER_RANK)
    try:
        model(idx, tgt[:, :3])  # wrong target shape: raises inside the root forward
        raised = False
    except (RuntimeError, ValueError):
        raised = True
    held = sum(1 for p in model.parameters() if meta(p).status.value != "not_available")
    model.eval()
    with torch.no_grad():
        got = model(idx, tgt)
        ref.eval()
        want = ref(idx, tgt)
    return raised, held, got, want, co.stats().trace_outcome


def test_a_forward_that_raises_leaves_nothing_gathered():
    for raised, held, got, want, outcome in run(2, _error_then_train, timeout=60):
        assert raised and held == 0
        assert torch.equal(got, want)  # eval is the same math on the same gathered values
        assert outcome == "recorded"
