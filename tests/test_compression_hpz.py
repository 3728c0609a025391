"""Node-local backward gathers with int8 weights (``attach(secondary_group=..., compression=
Compression(weights="int8"))``): with ``on="all"`` the node moves the forward gather's codes and
scales and training is bitwise the compressed training without hpZ; with ``on="replicas"`` the
node moves the compute dtype. ``stats().allgather_bytes`` counts what travelled, group by group."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harness import run

WIDTH, VOCAB, BLOCK, THRESHOLD = 24, 40, 32, 64
# small params (norms, biases) persistent, nothing kept for reuse: every other parameter is
# gathered in forward and again in backward (from the node with hpZ)
KNOBS = dict(persistence_threshold=THRESHOLD, fetch_unit_size=2000, max_reuse_distance=0)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(3 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, two blocks, head tied to the embedding; odd sizes so shards hold partial blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(F.linear(x, self.emb.weight).flatten(0, 1), idx.roll(1, 1).flatten())


def _train(spec, secondary: bool, precision: bool = False, layout=None, steps: int = 2) -> dict:
    """AdamW steps over 4 ranks (nodes {0, 1} and {2, 3}): losses, grad shards, ``model.state_dict()``,
    the last step's stats and the global ranks of the node group."""
    import torch.distributed as dist
    from parts.partition import Compression, MixedPrecision, attach, gathered, meta, partitioned, shards
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    torch.manual_seed(0)
    with partitioned(**(layout or {})):
        model = TinyLM()
    coordinator = attach(model, secondary_group=pairs[rank // 2] if secondary else None,
                         compression=Compression(**spec, block=BLOCK) if spec else None,
                         mixed_precision=MixedPrecision() if precision else None, **KNOBS)
    opt = torch.optim.AdamW(shards(model), lr=1e-2)
    g = torch.Generator().manual_seed(10 + rank)
    losses, grads = [], []
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (2, 8), generator=g)
        loss = model(idx)
        loss.backward()
        losses.append(loss.detach())
        grads.append([meta(p).grad_shard.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    with gathered(list(model.parameters())):
        state = {k: v.clone() for k, v in model.state_dict().items()}
    backward = [meta(p).layout.shard_numel for p in model.parameters() if meta(p).numel > THRESHOLD]
    return dict(losses=losses, grads=grads, state=state, stats=coordinator.stats(), backward=backward)


def _runs() -> dict:
    int8 = {"weights": "int8", "on": "all"}
    return dict(plain=_train(int8, False), hpz=_train(int8, True), fp32_hpz=_train(None, True))


def _bitwise(a: dict, b: dict) -> bool:
    return (all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))
            and all(torch.equal(x, y) for sa, sb in zip(a["grads"], b["grads"]) for x, y in zip(sa, sb))
            and a["state"].keys() == b["state"].keys()
            and all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"]))


def test_hpz_with_int8_weights_trains_bitwise_as_int8_without_it_and_the_node_moves_the_codes():
    from parts.comm.compressed import Codec, row_bytes
    for rank, out in enumerate(run(4, _runs, timeout=120)):
        plain, hpz, fp32_hpz = out["plain"], out["hpz"], out["fp32_hpz"]
        assert _bitwise(plain, hpz), rank
        assert not _bitwise(hpz, fp32_hpz)  # the codes are really in use
        assert hpz["stats"].secondary_params == fp32_hpz["stats"].secondary_params > 0
        node = ("0,1", "2,3")[rank // 2]
        moved = hpz["stats"].bytes_by_group[node]["allgather_bytes"]
        # each backward gather from the node: (k - 1) peers send their w / k rows of codes
        assert moved == sum((2 - 1) * 2 * row_bytes([s], Codec(8, BLOCK)) for s in hpz["backward"]), rank
        assert fp32_hpz["stats"].bytes_by_group[node]["allgather_bytes"] == sum(2 * 4 * s for s in hpz["backward"])
        assert moved <= 0.3 * fp32_hpz["stats"].bytes_by_group[node]["allgather_bytes"]
        for name, item in out.items():  # the stats count what the ledger saw, group by group
            stats = item["stats"]
            assert stats.allgather_bytes == sum(g.get("allgather_bytes", 0) for g in stats.bytes_by_group.values())


def _bf16_and_two_hop_runs() -> dict:
    int8, across = {"weights": "int8", "on": "all"}, {"weights": "int8", "on": "replicas"}
    two_hop = {"ranks_per_node": 2}
    return dict(plain=_train(int8, False, True), hpz=_train(int8, True, True),
                two_hop=_train(across, False, layout=two_hop), two_hop_hpz=_train(across, True, layout=two_hop))


def test_bf16_compute_and_replicas_only_codes_with_hpz_train_bitwise_as_without_it():
    from parts.comm.compressed import Codec, row_bytes
    for rank, out in enumerate(run(4, _bf16_and_two_hop_runs, timeout=120)):
        assert _bitwise(out["plain"], out["hpz"]), rank  # codes dequantized into bf16 on both paths
        node = ("0,1", "2,3")[rank // 2]
        backward = out["hpz"]["backward"]
        assert out["hpz"]["stats"].bytes_by_group[node]["allgather_bytes"] == sum(
            2 * row_bytes([s], Codec(8, BLOCK)) for s in backward)
        assert _bitwise(out["two_hop"], out["two_hop_hpz"]), rank
        # on="replicas": without hpZ each backward gather's node hop forwards 2 rows of codes;
        # with it the node gathers 2 shards' fp32 values instead (they never cross between nodes)
        assert out["two_hop_hpz"]["stats"].secondary_params > 0
        hpz_node = out["two_hop_hpz"]["stats"].bytes_by_group[node]["allgather_bytes"]
        plain_node = out["two_hop"]["stats"].bytes_by_group[node]["allgather_bytes"]
        assert hpz_node - plain_node == sum(2 * 4 * s - 2 * row_bytes([s], Codec(8, BLOCK)) for s in backward)
