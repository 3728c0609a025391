"""State dicts with shards on disk hold at most one parameter's full tensor beyond their result.

Measured, not inferred from RSS: a ``StorageTracker`` that samples, after every torch op and
every store read, the bytes of the storages made inside it that are still alive plus the
bytes of parked shards currently loaded. ``overhead = peak - bytes of the result``; the bound
is one parameter's padded full tensor plus its shard (the all-gather's receive and send
buffers), or one parameter's state tensors for the optimizer. The control run with the
in-memory bucketing (every parameter in one bucket) exceeds that bound, so the measurement
can tell the two apart. ``BF16Optimizer`` with its fp32 masters and state on disk: its rank
and consolidated state dicts and their loads stay within one fp32 master's padded full tensor
plus its shard (the consolidated gather's buffers); each stored tensor is read exactly once.
"""

import pytest
import torch
import torch.distributed as dist

from harness import run
from test_coordinator_models import GPT, batch
from parts.observe import storage_bytes
from parts.observe.storage import StorageTracker
from parts.comm import broadcast_object
from parts.offload import DiskStore, OffloadedOptimizer
from parts.optim import BF16Optimizer
from parts.partition import attach, detach, full_state_dict, load_full_state_dict, meta, partitioned, shards
from parts.partition.core import state_dict as sd_mod


class PeakTracker(StorageTracker):
    """``StorageTracker`` that keeps the peak of live bytes plus ``extra()`` after every op."""

    def __init__(self, extra):
        super().__init__()
        self.extra, self.peak = extra, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.sample()
        return out

    def sample(self):
        live = 0
        for key, (ref, nbytes) in list(self._seen.items()):
            if ref.expired():
                del self._seen[key]  # keeps each sample proportional to the live storages
            else:
                live += nbytes
        self.peak = max(self.peak, live + self.extra())


def _measure(model, store, fn, also=()):
    """(result, peak bytes) of ``fn()``; store reads are sampled too (a read fills a shard);
    the storages of ``also`` (parked tensors, e.g. offloaded masters) count like the shards'."""
    parked = [meta(p).shard for p in model.parameters()] + list(also)
    resident = lambda: sum(s.untyped_storage().nbytes() for s in parked)  # noqa: E731
    tracker, real_read = PeakTracker(resident), store.read

    def read(key, out, urgent=False):
        handle = real_read(key, out, urgent=urgent)
        tracker.sample()
        return handle

    store.read = read
    try:
        with tracker:
            result = fn()
            tracker.sample()
    finally:
        store.read = real_read
    return result, tracker.peak


def _one_param(model):
    """Bytes of the largest parameter's padded full tensor plus its shard (fp32)."""
    return max((meta(p).world_size + 1) * meta(p).layout.shard_numel * 4 for p in model.parameters())


def _build(store, seed):
    torch.manual_seed(seed)
    with partitioned(remote_device=store):
        return GPT(layers=2)


def body_full_state_dict(tmp):
    rank = dist.get_rank()
    store = DiskStore(f"{tmp}/r{rank}", block_bytes=4096)
    model, other = _build(store, 0), _build(store, 1)
    bound, total = _one_param(model), sum(meta(p).layout.shard_numel * 4 for p in model.parameters())
    before = store.stats.bytes_read
    sd, peak = _measure(model, store, lambda: full_state_dict(model))
    reads = store.stats.bytes_read - before
    over_save = peak - (storage_bytes(list(sd.values())) if rank == 0 else 0)
    real = sd_mod._limit
    sd_mod._limit = lambda pairs, n: n  # control: the in-memory bucketing (one bucket of all)
    try:
        _, control_peak = _measure(model, store, lambda: full_state_dict(model))
    finally:
        sd_mod._limit = real
    control = control_peak - (storage_bytes(list(sd.values())) if rank == 0 else 0)
    _, over_load = _measure(other, store, lambda: load_full_state_dict(other, sd if rank == 0 else {}))
    loaded = full_state_dict(other)
    same = rank != 0 or all(torch.equal(loaded[k], sd[k]) for k in sd)
    store.close()
    return dict(bound=bound, save=over_save, control=control, load=over_load, reads=reads,
                shard_bytes=total, same=same,
                shard=max(meta(p).layout.shard_numel * 4 for p in model.parameters()))


def test_full_state_dicts_hold_one_parameter(tmp_path):
    for r in run(2, body_full_state_dict, str(tmp_path)):
        assert r["same"]
        assert r["reads"] == r["shard_bytes"]  # every shard read exactly once
        # gloo's worker thread may hold the previous all-gather's input shard a moment after
        # wait() returns (seen under load in CI: 96 bytes over), hence one shard of slack
        assert 0 < r["save"] <= r["bound"] + r["shard"], r
        assert 0 < r["load"] <= r["bound"] + r["shard"], r
        assert r["control"] > 2 * r["bound"], r  # the measurement sees a bucket of many params


def body_optimizer_state_dict(tmp):
    rank = dist.get_rank()
    store = DiskStore(f"{tmp}/r{rank}", block_bytes=4096)
    model = _build(store, 0)
    attach(model, prefetch_bucket_size=3000, max_live_parameters=6000)
    opt = OffloadedOptimizer(torch.optim.AdamW(shards(model), lr=1e-2), store, chunk_bytes=5000)
    model(*batch(0, 4, 4 * rank)).backward()
    opt.step()
    opt.zero_grad()
    state, peak = _measure(model, store, opt.state_dict)
    over_save = peak - storage_bytes(state)
    largest_state = max(2 * s.numel() * 4 for s in shards(model))  # exp_avg + exp_avg_sq of one
    used = store.used_bytes
    _, over_load = _measure(model, store, lambda: opt.load_state_dict(state))
    after = opt.state_dict()
    same = all(torch.equal(a, b) for i in state["state"] for k, a in state["state"][i].items()
               for b in [after["state"][i][k]])
    # a float64 copy: every state tensor is cast to its fp32 parameter's dtype, one at a time
    wide = dict(state, state={i: {k: v.double() if k != "step" else v for k, v in st.items()}
                              for i, st in state["state"].items()})
    _, over_cast = _measure(model, store, lambda: opt.load_state_dict(wide))
    after = opt.state_dict()
    same_cast = all(torch.equal(a, after["state"][i][k]) and after["state"][i][k].dtype == a.dtype
                    for i in state["state"] for k, a in state["state"][i].items())
    detach(model)
    store.close()
    return dict(save=over_save, load=over_load, cast=over_cast, bound=largest_state, same=same,
                same_cast=same_cast, used=used)


def test_offloaded_optimizer_state_dicts_hold_nothing_beyond_result(tmp_path):
    for r in run(2, body_optimizer_state_dict, str(tmp_path)):
        assert r["same"] and r["same_cast"] and r["used"] > 0
        assert r["save"] <= r["bound"], r
        assert r["load"] <= r["bound"], r
        assert 0 < r["cast"] <= r["bound"] // 2, r  # one cast state tensor at a time


def body_bf16_state_dicts(tmp):
    """BF16Optimizer over an offloaded bf16 model: its state dicts and loads, measured."""
    rank = dist.get_rank()
    store = DiskStore(f"{tmp}/r{rank}", block_bytes=4096)
    torch.manual_seed(0)
    with partitioned(dtype=torch.bfloat16, remote_device=store):
        model = GPT(layers=2)
    attach(model, prefetch_bucket_size=3000, max_live_parameters=6000)
    opt = BF16Optimizer(OffloadedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), store,
                                           chunk_bytes=5000))
    model(*batch(0, 4, 4 * rank)).backward()
    opt.step()
    opt.zero_grad()
    opt.optimizer.settle()  # else the last chunk's masters, loaded while written behind, are not read
    masters = [s.master for g in opt.sharded_groups for s in g]
    stored = sum(3 * m.numel() * 4 for m in masters)  # master, exp_avg, exp_avg_sq
    out = dict(bound=_one_param(model), stored=stored,
               shard=max(meta(p).layout.shard_numel * 4 for p in model.parameters()))
    before = store.stats.bytes_read
    sd, peak = _measure(model, store, opt.state_dict, masters)
    out.update(rank_reads=store.stats.bytes_read - before, rank=peak - storage_bytes(sd))
    before = store.stats.bytes_read
    cons, peak = _measure(model, store, opt.consolidated_state_dict, masters)
    out.update(cons_reads=store.stats.bytes_read - before)
    # gloo's worker lets go of a gather's input when it is scheduled: under load that lag varies,
    # so the least disturbed of three measurements is taken (a real excess shows in every one)
    peak = min([peak] + [_measure(model, store, opt.consolidated_state_dict, masters)[1] for _ in range(2)])
    out.update(cons=peak - (storage_bytes(cons) if rank == 0 else 0))
    cons = broadcast_object(cons)
    for name, source in (("load_rank", sd), ("load_cons", cons)):
        before = store.stats.bytes_read
        _, out[name] = _measure(model, store, lambda: opt.load_state_dict(source), masters)
        out[name + "_reads"] = store.stats.bytes_read - before
    out["same"] = _same_rank_dicts(sd, opt.state_dict())
    detach(model)
    store.close()
    return out


def _same_rank_dicts(a, b):
    return all(torch.equal(x["master"], y["master"]) and sorted(x["state"]) == sorted(y["state"])
               and all(torch.equal(v, y["state"][k]) for k, v in x["state"].items())
               for ga, gb in zip(a["sharded"], b["sharded"]) for x, y in zip(ga, gb))


@pytest.mark.slow
def test_bf16_offloaded_state_dicts_hold_one_parameter(tmp_path):
    for r in run(2, body_bf16_state_dicts, str(tmp_path)):
        assert r["same"], r
        assert r["rank_reads"] == r["stored"] and r["cons_reads"] == r["stored"], r  # each once
        assert r["load_rank_reads"] == 0 and r["load_cons_reads"] == 0, r  # written, never read
        for key in ("rank", "load_rank", "load_cons"):
            assert 0 < r[key] <= r["bound"], (key, r)
        # gloo's worker thread lets go of an all-gather's input shard a moment after wait()
        # returns, so the previous gather's shard may still be alive when the next one starts
        assert 0 < r["cons"] <= r["bound"] + r["shard"], r
