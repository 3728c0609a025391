"""Character-level text every machine has: a seeded selection of the Python standard library's sources.

Tokens are byte values clipped to ASCII (0..127), so the vocabulary is fixed at 128 and a
user's own ``--data`` file works with the same model, with one exception: four spaces are one
token (``INDENT``, the control code 1, which source text never holds; a 1 in the text becomes
'?'). A level of indentation is then one prediction instead of four, so a small model keeps
its indentation consistent, and a window holds about 18% more of the standard library's text.
Losses are reported per character (``char_count``), so they compare with a plain character
model's.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path
from typing import Optional

import torch

VOCAB_SIZE = 128
INDENT = 1  # the token of four spaces
_INDENT_TEXT = b"    "
_CHARS = torch.ones(VOCAB_SIZE, dtype=torch.int64).index_fill_(0, torch.tensor([INDENT]), len(_INDENT_TEXT))


def stdlib_text(num_files: int = 40, seed: int = 1234) -> str:
    """Concatenate ``num_files`` source files of the standard library, chosen with ``seed``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if 2_000 < p.stat().st_size < 200_000)
    chosen = random.Random(seed).sample(files, min(num_files, len(files)))
    return "\n".join(path.read_text(encoding="utf-8", errors="replace") for path in chosen)


def encode(text: str) -> torch.Tensor:
    """Text to a 1-D int64 tensor of tokens: ASCII codes (other characters become '?'), four
    spaces one ``INDENT``."""
    data = text.encode("ascii", errors="replace").replace(bytes([INDENT]), b"?")
    data = data.replace(_INDENT_TEXT, bytes([INDENT]))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64).clamp_(max=127)


def decode(tokens: torch.Tensor) -> str:
    """Tokens back to text."""
    return bytes(tokens.tolist()).replace(bytes([INDENT]), _INDENT_TEXT).decode("ascii", errors="replace")


def char_count(tokens: torch.Tensor) -> torch.Tensor:
    """How many characters ``tokens`` stand for (a 0-d int64 tensor): losses per character divide by it."""
    return _CHARS[tokens].sum()


def load_splits(path: Optional[str], val_fraction: float = 0.1,
                chunk_tokens: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Encoded train and validation tokens from ``path`` or from the standard library.

    Every tenth chunk of ``chunk_tokens`` tokens is held out for validation, so both splits sample the
    same mix of files (a contiguous tail would validate on a few files unlike the rest).
    """
    text = Path(path).read_text(encoding="utf-8", errors="replace") if path else stdlib_text()
    chunks = encode(text).split(chunk_tokens)
    every = max(2, round(1 / val_fraction))
    val = [chunk for index, chunk in enumerate(chunks) if index % every == every - 1]
    train = [chunk for index, chunk in enumerate(chunks) if index % every != every - 1]
    return torch.cat(train), torch.cat(val)


def batch(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    """A random batch of ``(inputs, targets)`` windows drawn with ``generator``."""
    starts = torch.randint(len(tokens) - seq_len - 1, (batch_size,), generator=generator)
    inputs = torch.stack([tokens[s:s + seq_len] for s in starts.tolist()])
    targets = torch.stack([tokens[s + 1:s + seq_len + 1] for s in starts.tolist()])
    return inputs, targets
