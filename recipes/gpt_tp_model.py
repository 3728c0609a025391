"""The GPT of ``gpt_model.py`` with tensor parallelism: heads and MLP split across a tp group.

Same parameter names and the same math as ``gpt_model.GPT``: ``init_state_dict(config, seed)``
is the full state both models start from (``TPGPT`` builds each weight full from it, one module
at a time, and keeps its slice), so ``GPT(config).load_state_dict(init_state_dict(config, seed))``
is the non-parallel reference. Embeddings and the tied head are replicated over the tp group.
Attention dropout happens inside the tp region (each rank has other heads) and draws from the
``RNGTracker`` stream forked per tp rank; the residual dropout draws from the default stream,
which every rank of the tp group seeds alike.
"""

from __future__ import annotations

import math
import zlib
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from gpt_model import GPTConfig
from parts.parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["GPTConfig", "TPGPT", "init_state_dict", "full_init"]


def full_init(name: str, shape: tuple, config: GPTConfig, seed: int) -> torch.Tensor:
    """The initial value of parameter ``name``: GPT's init scheme, drawn from ``seed`` and ``name``."""
    if name.endswith("bias"):
        return torch.zeros(shape)
    if name.split(".")[-2].startswith("ln_"):
        return torch.ones(shape)
    residual = name.endswith(("out.weight", "proj.weight"))
    std = 0.02 / math.sqrt(2 * config.n_layer) if residual else 0.02
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def init_state_dict(config: GPTConfig, seed: int) -> dict[str, torch.Tensor]:
    """Full initial parameters of ``gpt_model.GPT(config)``, by name."""
    from gpt_model import GPT  # a throw-away model on the meta device gives names and shapes
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in GPT(config).named_parameters()}
    return {n: full_init(n, s, config, seed) for n, s in shapes.items()}


def tp_size(group: Any) -> int:
    """Ranks in the tp ``group`` (None: the default group, as the parallel layers read it)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _init(name: str, config: GPTConfig, seed: int) -> Callable[[torch.Tensor], Any]:
    def init(weight: torch.Tensor) -> None:
        weight.copy_(full_init(name, tuple(weight.shape), config, seed))
    return init


class Embedding(nn.Module):
    """A lookup table replicated over the tp group, initialised by ``full_init``."""

    def __init__(self, num: int, dim: int, name: str, config: GPTConfig, seed: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(full_init(name, (num, dim), config, seed))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight)


class TPSelfAttention(nn.Module):
    """Causal self-attention with ``n_head / tp`` heads on each tp rank."""

    def __init__(self, config: GPTConfig, group: Any, tracker: Any, prefix: str, seed: int) -> None:
        super().__init__()
        tp = tp_size(group)
        if config.n_head % tp:
            raise ValueError(f"{prefix}: n_head={config.n_head} is not divisible by tp size {tp}")
        self.n_head, self.width = config.n_head // tp, config.n_embd // tp  # this rank's heads
        self.dropout, self.tracker = config.dropout, tracker
        c = config.n_embd
        self.qkv = ColumnParallelLinear(c, 3 * c, group, chunks=3,
                                        init_method=_init(prefix + "qkv.weight", config, seed))
        self.proj = RowParallelLinear(c, c, group, init_method=_init(prefix + "proj.weight", config, seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).split(self.width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        with self.tracker.fork() if dropout > 0 and self.tracker is not None else nullcontext():
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, self.width))


class TPBlock(nn.Module):
    """Pre-norm block: tp attention then a column/row-parallel MLP, each with a residual."""

    def __init__(self, config: GPTConfig, group: Any, tracker: Any, prefix: str, seed: int) -> None:
        super().__init__()
        c = config.n_embd
        self.ln_1 = nn.LayerNorm(c)
        self.attn = TPSelfAttention(config, group, tracker, prefix + "attn.", seed)
        self.ln_2 = nn.LayerNorm(c)
        self.fc = ColumnParallelLinear(c, 4 * c, group,
                                       init_method=_init(prefix + "fc.weight", config, seed))
        self.out = RowParallelLinear(4 * c, c, group,
                                     init_method=_init(prefix + "out.weight", config, seed))
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln_2(x)))))


class TPGPT(nn.Module):
    """``gpt_model.GPT`` over a tensor-parallel ``group``; ``tracker`` is needed for dropout when tp > 1."""

    def __init__(self, config: GPTConfig, group: Any = None, *, tracker: Any = None,
                 seed: int = 0, checkpoint_fn: Optional[Callable[..., torch.Tensor]] = None) -> None:
        super().__init__()
        tp = tp_size(group)
        if config.dropout > 0 and tp > 1 and tracker is None:
            raise ValueError("TPGPT: dropout > 0 with tp > 1 needs an RNGTracker (tracker=...) "
                             "so that each tp rank drops different attention weights")
        self.config, self.checkpoint_fn = config, checkpoint_fn
        self.wte = Embedding(config.vocab_size, config.n_embd, "wte.weight", config, seed)
        self.wpe = Embedding(config.block_size, config.n_embd, "wpe.weight", config, seed)
        self.blocks = nn.ModuleList(TPBlock(config, group, tracker, f"blocks.{i}.", seed)
                                    for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = self.checkpoint_fn(block, x) if self.checkpoint_fn and self.training else block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied output projection, replicated
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
