"""Generate with a ZeRO-3 model: ``parts.partition.generating`` against a gather per decoding step,
then hand the weights to Hugging Face with ``parts.export``.

    torchrun --standalone --nproc-per-node 2 recipes/generate.py
    torchrun --standalone --nproc-per-node 2 recipes/generate.py --steps 20 --tokens 48 --export out/hf
    torchrun --standalone --nproc-per-node 2 recipes/generate.py --device cuda   # a GPU per rank

A small GPT-2 (a config, no download) is built under ``partitioned()``, attached and trained
``--steps`` steps on Python text (recipes/chardata.py). Each rank then generates ``--tokens``
greedy tokens from its own prompt (of its own length) three ways: without the context (every
decoding step gathers every layer; ``synced_gpus=True`` keeps the ranks in lock step), inside
``generating(model)`` (the model gathered once) and inside ``generating(model,
memory_budget=...)`` below the model's size (layers streamed). Rank 0 prints each way's
tokens/s and text; every way must give the tokens of the unsharded model with the same weights.
Training then goes on for one more step, as it would have without generating.

``--export DIR``: the weights are saved as a sharded DCP checkpoint (``sharded_state_dict``,
no rank holds the full model), streamed into ``DIR/model.safetensors`` by ``parts.export`` on
rank 0, and loaded back with ``GPT2LMHeadModel.from_pretrained(DIR)``. Needs
``pip install "parts[hf]"``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import devices  # noqa: E402
from chardata import VOCAB_SIZE, batch, decode, load_splits  # noqa: E402

from parts.comm import dcp  # noqa: E402
from parts.export import export  # noqa: E402
from parts.partition import (attach, full_state_dict, generating, partitioned, sharded_state_dict,  # noqa: E402
                             shards)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: torch.Tensor, steps: int,
           seq_len: int, gen: torch.Generator, device: torch.device) -> float:
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        x, = devices.to(device, batch(data, 4, seq_len, gen)[0])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()


def _timed(fn) -> tuple[float, torch.Tensor]:
    dist.barrier()
    start = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - start, tokens


def main() -> None:
    """Train, generate three ways, compare, optionally export."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--export", default=None, help="export the trained weights into this directory")
    devices.add_device_flag(parser)
    args = parser.parse_args()
    device = devices.init(args.device)
    rank = dist.get_rank()
    config = transformers.GPT2Config(vocab_size=VOCAB_SIZE, n_embd=args.n_embd, n_layer=args.n_layer, n_head=4,
                                     n_positions=max(args.seq_len, 16 + args.tokens))
    torch.manual_seed(0)
    with partitioned(device=device):
        model = transformers.GPT2LMHeadModel(config)
    # nothing kept gathered between steps, one fetch unit per block: streaming can stay under a budget
    attach(model, persistence_threshold=0, fetch_unit_size=13 * args.n_embd ** 2)
    optimizer = torch.optim.AdamW(shards(model), lr=3e-3)
    train, _ = load_splits(None)
    gen = torch.Generator().manual_seed(rank)
    loss = _train(model, optimizer, train, args.steps, args.seq_len, gen, device)
    model.eval()
    start = torch.randint(0, len(train) - 16, (1,), generator=gen).item()
    prompt = train[start:start + 8 + 4 * rank].unsqueeze(0).to(device)  # prompts of different lengths per rank
    kw = dict(max_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    plain = transformers.GPT2LMHeadModel(config)
    plain.load_state_dict(full_state_dict(model, rank0_only=False))
    plain.to(device)
    reference = plain.eval().generate(prompt, **kw)
    below = sum(p.numel() * 4 for p in plain.parameters()) * 3 // 4

    def inside(budget):
        def go():
            with generating(model, memory_budget=budget):
                return model.generate(prompt, **kw)
        return go

    ways = {"per-step gathers": lambda: model.generate(prompt, synced_gpus=True, **kw),
            "generating (gathered once)": inside(None),
            f"generating (streamed, budget {below >> 10} KiB)": inside(below)}
    for name, fn in ways.items():
        seconds, tokens = _timed(fn)
        same = torch.equal(tokens, reference)
        if rank == 0:
            text = decode(tokens[0, prompt.shape[1]:].cpu()).replace("\n", "\\n")
            print(f"{name:40s} {args.tokens / seconds:8.1f} tokens/s  equal to unsharded: {same}  {text!r}")
    after = _train(model, optimizer, train, 1, args.seq_len, gen, device)
    if rank == 0:
        print(f"loss after {args.steps} steps {loss:.4f}, after one more step {after:.4f}")
    if args.export:
        _export(model, args.export, rank)
    dist.destroy_process_group()


def _export(model: torch.nn.Module, out: str, rank: int) -> None:
    """Sharded checkpoint -> safetensors (rank 0) -> from_pretrained, checked against the weights."""
    checkpoint = os.path.join(out, "dcp")
    dcp.save(sharded_state_dict(model), checkpoint_id=checkpoint)
    full = full_state_dict(model, rank0_only=False)
    if rank == 0:
        model.config.save_pretrained(checkpoint)
        result = export(checkpoint, out)
        loaded = transformers.GPT2LMHeadModel.from_pretrained(out).state_dict()
        same = all(torch.equal(loaded[k], v.cpu()) for k, v in full.items() if k in loaded)
        print(f"exported {result.tensors} tensors to {result.files[0]}; from_pretrained equal: {same}")
    dist.barrier()


if __name__ == "__main__":
    main()
