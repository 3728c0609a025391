"""Where does bf16 training lose its distance to fp32? One small experiment per hypothesis.

One process, plain torch (no sharding: each variant changes one numeric choice of the
bf16 recipe and nothing else), the recipes' GPT, 2 micro-batches per step, AdamW on fp32
masters unless the variant says otherwise. Prints the final training loss and the
validation loss after ``--steps`` steps, and their relative gap to the fp32 run.

    PYTHONPATH=$PWD:$PWD/recipes python benchmarks/precision_experiments.py --steps 30
    PYTHONPATH=$PWD:$PWD/recipes python benchmarks/precision_experiments.py --device cuda  # one GPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import devices  # noqa: E402
from chardata import VOCAB_SIZE, batch, load_splits  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402
from record import record  # noqa: E402

BF16 = torch.bfloat16

# name: (init from bf16-rounded weights, tied grads summed in fp32, micro-batch accumulation dtype,
#        keep fp32 modules, masters in fp32)
VARIANTS = {
    "fp32": None,
    "masters from bf16-rounded init (DeepSpeed-like)": dict(round_init=True),
    "H1 masters from fp32 init (FSDP2-like)": dict(),
    "H2a tied grads summed in fp32": dict(tie_fp32=True),
    "H2b micro-batches accumulated in bf16": dict(accum=BF16),
    "H3 LayerNorms in fp32": dict(keep=(nn.LayerNorm,)),
    "H3 LayerNorms + embeddings in fp32": dict(keep=(nn.LayerNorm, nn.Embedding)),
    "H4 no fp32 master (bf16 write-back each step)": dict(round_init=True, bf16_master=True),
}


class Untied(GPT):
    """The recipes' GPT whose output projection reads a separate copy of the tied weight."""

    def forward(self, idx, targets):
        where = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx).to(self.head.dtype) + self.wpe(where).to(self.head.dtype)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x).to(self.head.dtype), self.head)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def _keep_fp32(model: nn.Module, kinds: tuple) -> None:
    """Modules of ``kinds`` compute in fp32: their params stay fp32, inputs cast in, outputs cast back."""
    for module in model.modules():
        if isinstance(module, kinds):
            module.float()
            if isinstance(module, nn.LayerNorm):
                module.register_forward_pre_hook(lambda m, args: (args[0].float(),))
                module.register_forward_hook(lambda m, args, out: out.to(BF16))


def train(variant, args, tokens, val, device: torch.device = torch.device("cpu")) -> tuple[float, float]:
    """Train one variant on ``device``; return (final training loss, validation loss)."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=VOCAB_SIZE, block_size=args.seq, n_layer=args.layers, n_embd=args.width)
    model = Untied(config).to(device)
    model.head = nn.Parameter(model.wte.weight.detach().clone())
    names = [n for n, _ in model.named_parameters() if n != "head"]
    masters = {n: p.detach().clone() for n, p in model.named_parameters() if n != "head"}
    v = variant or {}
    if variant is not None:
        model.to(BF16)
        _keep_fp32(model, v.get("keep", ()))
        if v.get("round_init"):
            masters = {n: m.to(BF16).float() for n, m in masters.items()}
    params = dict(model.named_parameters())
    if v.get("bf16_master"):
        masters = {n: m.to(BF16) for n, m in masters.items()}
    opt = torch.optim.AdamW(list(masters.values()), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    loss_value = 0.0
    for _ in range(args.steps):
        with torch.no_grad():
            for n in names:
                params[n].copy_(masters[n])
            params["head"].copy_(masters["wte.weight"])
        grads = {n: None for n in names}
        total = 0.0
        for _ in range(args.micro):
            loss = model(*devices.to(device, *batch(tokens, args.batch, args.seq, gen))) / args.micro
            loss.backward()
            total += loss.item()
            if v.get("accum") is None:
                _collect(model, grads, v)
        if v.get("accum") is not None:
            _collect(model, grads, v)
        for n in names:
            masters[n].grad = grads[n].to(masters[n].dtype)
        opt.step()
        opt.zero_grad()
        loss_value = total
    with torch.no_grad():
        for n in names:
            params[n].copy_(masters[n])
        params["head"].copy_(masters["wte.weight"])
        vgen = torch.Generator().manual_seed(2)
        val_loss = sum(model(*devices.to(device, *batch(val, args.batch, args.seq, vgen))).item()
                       for _ in range(8)) / 8
    return loss_value, val_loss


def _collect(model: nn.Module, grads: dict, v: dict) -> None:
    """Add this micro-batch's grads into ``grads`` in fp32 (the tied pair summed as ``v`` says)."""
    params = dict(model.named_parameters())
    head = params["head"].grad
    for n, p in params.items():
        if n == "head" or p.grad is None:
            continue
        g = p.grad
        if n == "wte.weight":
            g = (g.float() + head.float()) if v.get("tie_fp32") or g.dtype == torch.float32 else g + head
        g = g.float()
        grads[n] = g if grads[n] is None else grads[n] + g
        p.grad = None
    params["head"].grad = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``args.device`` comes back resolved to ``cpu`` or ``cuda``."""
    ap = argparse.ArgumentParser(description=__doc__)
    for flag, default in [("--steps", 30), ("--micro", 2), ("--batch", 8), ("--seq", 64),
                          ("--layers", 4), ("--width", 128)]:
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--only", default=None, help="substring of the variants to run")
    return devices.parse_with_device(ap, argv)


def main() -> None:
    """Train every variant and print its losses beside the first (fp32) run's."""
    args = parse_args()
    device = devices.pick(args.device)
    torch.set_num_threads(1)
    tokens, val = load_splits(None)
    base = None
    rows = []
    for name, variant in VARIANTS.items():
        if args.only and variant is not None and args.only not in name:
            continue
        final, vloss = train(variant, args, tokens, val, device)
        base = base or (final, vloss)
        print(f"{name:48s} train {final:.4f} ({100 * (final / base[0] - 1):+.2f}%)  "
              f"val {vloss:.4f} ({100 * (vloss / base[1] - 1):+.2f}%)", flush=True)
        rows.append({"variant": name, "train_loss": round(final, 4),
                     "train_vs_first": f"{100 * (final / base[0] - 1):+.2f}%", "val_loss": round(vloss, 4),
                     "val_vs_first": f"{100 * (vloss / base[1] - 1):+.2f}%"})
    record("precision_experiments" + ("_cuda" if args.device == "cuda" else ""), {"rows": rows})


if __name__ == "__main__":
    main()
