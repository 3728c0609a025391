"""What the integrations' snapshots (``parts.comm.Snapshots``) hold beside the shards: the RNG
states Trainer's and accelerate's checkpoints hold (Python, numpy, torch, CUDA), and opaque
entries: values whose keys a restore need not know in advance (a scheduler's state, param groups).
"""

from __future__ import annotations

import io
import random
from typing import Any, Optional

import numpy as np
import torch


def rng_states() -> dict[str, Any]:
    """This process's RNG states as Trainer's checkpoints hold them, numpy's key as a tensor."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                    gauss), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def set_rng_states(state: dict[str, Any]) -> None:
    """Put back the states ``rng_states`` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.random.set_rng_state_all(state["cuda"])


def to_bytes(value: Any) -> bytes:
    """``value`` as one opaque entry of a snapshot (``torch.save``: tensors, numbers, strings, containers)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_bytes(raw: Optional[bytes]) -> Any:
    """The value ``to_bytes`` made (None for an empty entry)."""
    return torch.load(io.BytesIO(raw), weights_only=True) if raw else None
