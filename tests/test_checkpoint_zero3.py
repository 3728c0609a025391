"""parts.checkpoint inside a ZeRO-3 model: recompute in backward fetches the block again, same grads."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run
from parts.checkpoint import CheckpointPolicy, checkpoint
from parts.partition import attach, meta, partitioned

WIDTH = 24


class Block(nn.Module):
    """A residual MLP block with dropout: recompute must replay the same mask."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 3 * WIDTH)
        self.down = nn.Linear(3 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(self.down(F.gelu(self.up(self.norm(x)))), p=0.3, training=self.training)


class Stack(nn.Module):
    def __init__(self, use_checkpoint: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)
        self.use_checkpoint = use_checkpoint
        self.policy = CheckpointPolicy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, policy=self.policy) if self.use_checkpoint else block(x)
        return self.head(x).square().mean()


def _train_steps(use_checkpoint: bool, steps: int = 3):
    """Grad shards, losses and coordinator stats of a sharded Stack after a few backward passes."""
    torch.manual_seed(0)
    with partitioned():
        model = Stack(use_checkpoint)
    # leaf fetch units, so the recompute of a block has params of its own to fetch again
    coordinator = attach(model, persistence_threshold=0, max_reuse_distance=0, fetch_unit_size=0)
    generator = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses = []
    for step in range(steps):
        torch.manual_seed(1000 + step)  # the dropout stream, the same for both variants
        loss = model(torch.randn(5, WIDTH, generator=generator))
        loss.backward()
        losses.append(loss.item())
    grads = [meta(p).grad_shard.clone() for p in model.parameters()]
    return losses, grads, coordinator.stats()


def _compare():
    plain_losses, plain_grads, plain_stats = _train_steps(False)
    ckpt_losses, ckpt_grads, ckpt_stats = _train_steps(True)
    return (plain_losses == ckpt_losses,
            all(torch.equal(a, b) for a, b in zip(plain_grads, ckpt_grads)),
            plain_stats.regathered_params, ckpt_stats.regathered_params,
            ckpt_stats.allgather_bytes - plain_stats.allgather_bytes)


def test_checkpointed_blocks_in_a_zero3_model_match_bitwise_and_refetch():
    for same_losses, same_grads, plain_regathers, ckpt_regathers, extra_bytes in run(2, _compare, timeout=120):
        assert same_losses and same_grads  # dropout replayed exactly, fp32 math unchanged
        assert plain_regathers == 0 and ckpt_regathers > 0  # recompute fetched the blocks again
        assert extra_bytes > 0
