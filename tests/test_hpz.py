"""Node-local backward gathers (``attach(model, secondary_group=node_group)``): training is
bitwise the training without them, backward's all-gathers stay on the node group, and the
node groups are checked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import run

try:  # imported here, before the harness forks its workers, so they do not import it each
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError:
    GPT2Config = GPT2LMHeadModel = None

WIDTH, VOCAB = 16, 32
# small params (norms, biases) persistent, a block per fetch unit, nothing kept for reuse:
# every non-persistent parameter is gathered in forward and again in backward
KNOBS = dict(persistence_threshold=64, fetch_unit_size=2000, max_reuse_distance=0)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(3 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, blocks (checkpointed with ``parts.checkpoint`` if asked), head tied to the embedding."""

    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.ckpt = ckpt

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        from parts.checkpoint import checkpoint
        x = self.emb(idx)
        for block in self.blocks:
            x = checkpoint(block, x) if self.ckpt else block(x)
        logits = F.linear(x, self.emb.weight)
        return F.cross_entropy(logits.flatten(0, 1), idx.roll(1, 1).flatten())


def _gpt2() -> nn.Module:
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _node_group():
    """This rank's node: {0, 1} or {2, 3} (every rank makes both groups)."""
    import torch.distributed as dist
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return pairs[dist.get_rank() // 2]


def _train(kind: str, secondary: bool, micro: int = 1, steps: int = 2, layout=None) -> dict:
    """Steps of AdamW on ``kind`` ("tiny", "ckpt", "gpt2"): losses, grad shards, the weights
    through ``model.state_dict()``, the stats and the ledger of the last step."""
    import torch.distributed as dist
    from parts.comm import comm_counter
    from parts.comm.counter import ledger_since
    from parts.partition import attach, gathered, meta, partitioned, shards
    rank = dist.get_rank()
    node = _node_group()
    torch.manual_seed(0)
    with partitioned(**(layout or {})):
        model = _gpt2() if kind == "gpt2" else TinyLM(ckpt=kind == "ckpt")
    coordinator = attach(model, secondary_group=node if secondary else None, **KNOBS)
    opt = torch.optim.AdamW(shards(model), lr=1e-2)
    g = torch.Generator().manual_seed(10 + rank)
    losses, grads = [], []
    for _ in range(steps):
        before = comm_counter.by_group()
        for _ in range(micro):
            idx = torch.randint(0, VOCAB, (2, 8), generator=g)
            loss = model(input_ids=idx, labels=idx).loss if kind == "gpt2" else model(idx)
            (loss / micro).backward()
            losses.append(loss.detach())
        ledger = ledger_since(before, comm_counter.by_group())
        grads.append([meta(p).grad_shard.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    with gathered(list(model.parameters())):
        state = {k: v.clone() for k, v in model.state_dict().items()}
    return dict(losses=losses, grads=grads, state=state, stats=coordinator.stats(), ledger=ledger)


def _pair(kind: str, micro: int = 1, layout=None) -> tuple[dict, dict]:
    return _train(kind, False, micro, layout=layout), _train(kind, True, micro, layout=layout)


def _assert_bitwise(plain: dict, hpz: dict) -> None:
    assert all(torch.equal(a, b) for a, b in zip(plain["losses"], hpz["losses"]))
    for step_a, step_b in zip(plain["grads"], hpz["grads"]):
        assert all(torch.equal(a, b) for a, b in zip(step_a, step_b))
    assert plain["state"].keys() == hpz["state"].keys()
    assert all(torch.equal(plain["state"][k], hpz["state"][k]) for k in plain["state"])


def _allgather(ledger: dict, group: str) -> int:
    return ledger.get(group, {}).get("allgather_bytes", 0)


def test_backward_gathers_from_the_node_equal_full_gathers_bitwise_and_leave_the_full_group():
    for rank, (plain, hpz) in enumerate(run(4, _pair, "tiny", timeout=120)):
        _assert_bitwise(plain, hpz)
        node, full = ("0,1", "2,3")[rank // 2], "0,1,2,3"
        assert hpz["stats"].secondary_params > 0 and plain["stats"].secondary_params == 0
        assert hpz["stats"].secondary_bytes > 0 and plain["stats"].secondary_bytes == 0
        backward_share = _allgather(plain["ledger"], full) - _allgather(hpz["ledger"], full)
        # every backward gather moved to the node: a third of the padded param per rank instead
        # of three quarters at world 4, nodes of 2 (2 * s where the full group moves 3 * s)
        assert backward_share > 0 and 3 * _allgather(hpz["ledger"], node) == 2 * backward_share
        assert _allgather(plain["ledger"], node) == 0
        plain_step = _allgather(plain["ledger"], full) + plain["ledger"][full]["reduce_scatter_bytes"]
        assert 0.25 < backward_share / plain_step <= 1 / 3  # forward AG + backward AG + RS -> AG + RS
        assert hpz["ledger"][full]["reduce_scatter_bytes"] == plain["ledger"][full]["reduce_scatter_bytes"]


def test_hf_model_with_tied_and_persistent_params_trains_bitwise_with_accumulation():
    if GPT2Config is None:
        pytest.skip("transformers is not installed (parts[hf])")
    for plain, hpz in run(4, _pair, "gpt2", 2, timeout=120):
        _assert_bitwise(plain, hpz)
        assert hpz["stats"].secondary_params > 0


def test_checkpointed_blocks_recompute_from_the_node_bitwise():
    for plain, hpz in run(4, _pair, "ckpt", timeout=120):
        _assert_bitwise(plain, hpz)
        assert hpz["stats"].secondary_params > 0


def _shards_change_between_forward_and_backward(secondary: bool) -> tuple[list, list]:
    """A forward, then the shards change (an optimizer step; a direct write), then its backward."""
    import torch.distributed as dist
    from parts.partition import attach, meta, partitioned, shards
    node = _node_group()
    torch.manual_seed(0)
    with partitioned():
        model = TinyLM()
    attach(model, secondary_group=node if secondary else None, **KNOBS)
    opt = torch.optim.AdamW(shards(model), lr=1e-2)
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    model(torch.randint(0, VOCAB, (2, 8), generator=g)).backward()
    losses, grads = [], []
    for change in ("step", "write"):
        loss = model(torch.randint(0, VOCAB, (2, 8), generator=g))
        if change == "step":
            opt.step()
        else:
            with torch.no_grad():
                for shard in shards(model):
                    shard.add_(0.5)
        opt.zero_grad()
        loss.backward()
        losses.append(loss.detach())
        grads.append([meta(p).grad_shard.clone() for p in model.parameters()])
    return losses, grads


def _changed_pair() -> tuple:
    return _shards_change_between_forward_and_backward(False), _shards_change_between_forward_and_backward(True)


def test_a_secondary_shard_is_never_used_after_its_shard_changed():
    for plain, hpz in run(4, _changed_pair, timeout=120):
        assert all(torch.equal(a, b) for a, b in zip(plain[0], hpz[0]))
        for step_a, step_b in zip(plain[1], hpz[1]):  # backward gathered the changed shards
            assert all(torch.equal(a, b) for a, b in zip(step_a, step_b))


def _hybrid_layout() -> dict:
    import torch.distributed as dist
    rank = dist.get_rank()
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return {"group": rows[rank // 2], "replicate_group": columns[rank % 2]}


def _layout_pairs() -> tuple:
    return _pair("tiny", layout=_hybrid_layout()), _pair("tiny", layout={"ranks_per_node": 2})


def test_a_hybrid_layout_is_left_as_it_is_and_two_hop_gathers_cross_nodes_half_as_much():
    for rank, ((plain, hpz), (two_hop, both)) in enumerate(run(4, _layout_pairs, timeout=120)):
        _assert_bitwise(plain, hpz)  # sharded within the node: backward gathers are node-local already
        assert hpz["stats"].secondary_params == 0 and hpz["ledger"] == plain["ledger"]
        _assert_bitwise(two_hop, both)
        across = ("0,2", "1,3")[rank % 2]  # the two-hop collectives' group across the nodes
        assert 2 * _allgather(both["ledger"], across) == _allgather(two_hop["ledger"], across) > 0


def _refused(layout: dict, node_ranks: list) -> str:
    import torch.distributed as dist
    from parts.partition import attach, partitioned
    groups = {tuple(ranks): dist.new_group(ranks) for ranks in node_ranks}  # every rank makes every group
    mine = next(g for ranks, g in groups.items() if dist.get_rank() in ranks)
    with partitioned(**layout):
        model = TinyLM()
    try:
        attach(model, secondary_group=mine, **KNOBS)
    except ValueError as e:
        return str(e)
    return "no error"


def _bad_node_groups() -> tuple[str, str]:
    across = _refused({}, [[0, 2], [1, 3]])  # the groups across the nodes, not within
    return across, _refused(_hybrid_layout(), [[0, 3], [1, 2]])  # not within the shard group


def test_node_groups_that_are_not_blocks_of_the_shard_group_are_refused_on_every_rank_naming_them():
    for rank, (across, outside) in enumerate(run(4, _bad_node_groups)):
        assert "secondary_group" in across and "[0, 1, 2, 3]" in across and "[0, 2]" in across
        shard = ("[0, 1]", "[2, 3]")[rank // 2]
        assert f"shard group (global ranks {shard})" in outside and "[0, 3]" in outside
