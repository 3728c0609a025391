"""Native flatten/copy ops: flatten, unflatten, copy_in, copy_out.

Two implementations: ``parts.csrc.native`` (C++ via ``torch.ops.parts``, built with ninja on first
use and cached in ~/.cache/parts) and ``parts.csrc.reference`` (pure torch). The functions here
use the native one for an op only where ``NATIVE_DEFAULT`` says it measured faster, the tensors
are on CPU, and the build works; otherwise the reference, with one ``NativeFallbackWarning``
per process if the build failed. ``PARTS_CSRC_FALLBACK=1`` forces the reference everywhere.

``host_cache`` is a CPU allocator from the same build that keeps freed large blocks for the
next request of their size (``parts.offload``'s stores install it).
"""

from __future__ import annotations

import os
import warnings
from typing import Sequence

import torch

from . import host_cache, native, reference
from ._build import NativeUnavailable

__all__ = ["flatten", "unflatten", "copy_in", "copy_out", "backend", "NATIVE_DEFAULT", "host_cache",
           "NativeFallbackWarning", "native", "reference"]

# Per-op default from benchmarks/bench_native.py --threads 1 (the per-rank setting): geometric
# mean of native/torch time over 1-256 MB x 10-1000 tensors, fp32, world 2, on a busy 2-core
# VM. Native wins by skipping per-tensor Python/dispatch work; both tie when one big memcpy
# dominates. With 2 threads on a loaded machine native won by more (one parallel region
# per call instead of one per tensor).
NATIVE_DEFAULT: dict[str, bool] = {
    "flatten": True,  # 0.88 (0.61-0.73 at 1 MB with >=100 tensors; 0.84-1.06 elsewhere)
    "unflatten": True,  # 0.40 (0.23-0.47 everywhere)
    "copy_in": True,  # 0.43 (0.06-0.70; ties, 0.89-1.09, at 16-256 MB over 10-100 tensors)
    "copy_out": True,  # 0.40 (0.12-0.64; ties, 0.90-1.02, at 16-256 MB over 10-100 tensors)
}

_warned = False


class NativeFallbackWarning(UserWarning):
    """The native ops could not be built; parts.csrc runs its pure-torch implementation."""


def _use_native(op: str, t: torch.Tensor) -> bool:
    """True if `op` on tensors like `t` should run the native kernel."""
    global _warned
    if not NATIVE_DEFAULT[op] or t.device.type != "cpu" or _forced_fallback():
        return False
    if native.available():
        return True
    if not _warned:
        _warned = True
        warnings.warn(f"parts.csrc: native ops unavailable ({_error()}); using pure torch",
                      NativeFallbackWarning, stacklevel=3)
    return False


def _forced_fallback() -> bool:
    """True if PARTS_CSRC_FALLBACK asks for the pure-torch implementation."""
    return os.environ.get("PARTS_CSRC_FALLBACK", "") not in ("", "0")


def _error() -> str:
    """Why the native build is unavailable."""
    try:
        native.load_native()
    except NativeUnavailable as e:
        return str(e)
    return "available"


def _impl(op: str, t: torch.Tensor):
    """The module (native or reference) that runs `op` for tensors like `t`."""
    return native if _use_native(op, t) else reference


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate `tensors` (one dtype and device) into a new 1-D tensor."""
    first = tensors[0] if len(tensors) else torch.empty(0)
    return _impl("flatten", first).flatten(tensors)


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Return views into 1-D `flat` with the shapes of `like`, back to back from offset 0.

    Only the shapes of `like` are used (flat may be fp32 master weights for bf16 params);
    trailing elements of `flat` (padding) are allowed.
    """
    return _impl("unflatten", flat).unflatten(flat, like)


def copy_in(srcs: Sequence[torch.Tensor], dst: torch.Tensor, offsets: Sequence[int]) -> None:
    """Pack: dst.view(-1)[offsets[i] : offsets[i] + srcs[i].numel()] = srcs[i].reshape(-1)."""
    _impl("copy_in", dst).copy_in(srcs, dst, offsets)


def copy_out(src: torch.Tensor, dsts: Sequence[torch.Tensor], world_size: int,
             offsets: Sequence[int], shard_numels: Sequence[int]) -> None:
    """Unpack a gathered buffer of `world_size` equal chunks into full tensors, dropping padding.

    dsts[i].view(-1) = cat over ranks r of src[r*chunk + offsets[i] :][: shard_numels[i]],
    truncated to dsts[i].numel().
    """
    _impl("copy_out", src).copy_out(src, dsts, world_size, offsets, shard_numels)


def backend() -> str:
    """Per-op implementation that the default calls use on CPU, e.g. "flatten=torch,copy_out=native".

    Builds the extension if an op wants it; "torch" where the native op is not the default,
    is unavailable, or PARTS_CSRC_FALLBACK is set.
    """
    ok = not _forced_fallback() and (not any(NATIVE_DEFAULT.values()) or native.available())
    return ",".join(f"{op}={'native' if use and ok else 'torch'}" for op, use in NATIVE_DEFAULT.items())
