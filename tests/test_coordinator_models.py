"""Small GPT-style models and helpers shared by the coordinator tests (no tests here)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from parts.partition import gathered, partition_module, shards
from parts.partition.coordinator import attach

VOCAB, DIM, HEADS, SEQ = 53, 24, 4, 12  # uneven sizes: shards get padding at world 2..4


class Block(nn.Module):
    """Pre-LN transformer block (attention + MLP), dropout 0."""

    def __init__(self, d: int = DIM, h: int = HEADS) -> None:
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # no qkv bias: the key bias has an exactly-zero true gradient (softmax is shift invariant),
        # so its grad is rounding noise that AdamW would blow up to +-lr steps
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Tied input/output embedding used as ``F.linear(x, self.wte.weight)`` (an external use)."""

    def __init__(self, layers: int = 3, ckpt: object = False, skip_odd: bool = False) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(DIM)
        self.ckpt, self.skip_odd, self.calls = ckpt, skip_odd, 0

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for i, block in enumerate(self.blocks):
            if self.skip_odd and self.calls % 2 == 1 and i == 1:
                continue  # dynamic graph: block 1 skipped on odd calls
            if self.ckpt:
                x = checkpoint(block, x, use_reentrant=self.ckpt == "reentrant")
            else:
                x = block(x)
        self.calls += 1
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class Head(nn.Module):
    """Untied output projection (for the budget test: no parameter held across modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class UntiedGPT(GPT):
    """GPT with a separate output head."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__(layers)
        self.head = Head()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


@dataclass
class Pair:
    """A dataclass output."""

    a: torch.Tensor
    b: torch.Tensor


class DictOut(nn.Module):
    """A submodule returning a dict of tensors and one returning a dataclass."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> dict:
        y = self.lin(x)
        return {"y": y, "extra": (y * 2, None)}


class PairOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> Pair:
        return Pair(self.lin(x), torch.tanh(self.lin(x)))


class Structured(nn.Module):
    """Modules whose forwards return dicts and dataclasses."""

    def __init__(self) -> None:
        super().__init__()
        self.d, self.p, self.last = DictOut(), PairOut(), nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.d(x)
        pair = self.p(out["y"] + out["extra"][0])
        return self.last(pair.a * pair.b).pow(2).mean()


def batch(step: int, rows: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic global batch of ``step`` (rows ``offset .. offset+rows``)."""
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (64, SEQ), generator=g)
    tgt = torch.randint(0, VOCAB, (64, SEQ), generator=g)
    return idx[offset:offset + rows], tgt[offset:offset + rows]


def rank_info() -> tuple[int, int]:
    """(rank, world size) of the harness process group."""
    return dist.get_rank(), dist.get_world_size()


def make_pair(model_cls=GPT, seed: int = 0, **kwargs):
    """An unsharded reference and a sharded copy with the same initial values."""
    torch.manual_seed(seed)
    ref = model_cls(**kwargs)
    model = partition_module(copy.deepcopy(ref))
    return ref, model


def full_params(model: nn.Module) -> list[torch.Tensor]:
    """Full values of every parameter of a sharded model (gathered, cloned)."""
    params = list(model.parameters())
    with gathered(params):
        return [p.detach().clone() for p in params]


def train_sharded(model, steps: int, per_rank: int, lr: float = 1e-2, **knobs):
    """Train with the coordinator; returns (global mean losses, coordinator)."""
    rank, world = rank_info()
    coordinator = attach(model, **knobs)
    opt = torch.optim.AdamW(shards(model), lr=lr)
    losses = []
    for step in range(steps):
        loss = model(*batch(step, per_rank, rank * per_rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append((mean / world).item())
    return losses, coordinator


def train_reference(ref, steps: int, rows: int, lr: float = 1e-2):
    """Unsharded single-process training on the concatenated batch."""
    opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = ref(*batch(step, rows))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
