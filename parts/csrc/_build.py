"""Build (once per machine, cached) and load the C++ ops of parts.csrc into torch.ops.parts."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

_SOURCES = ["ops.cpp", "host_cache.cpp"]
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "ok": bool, "error": str once load_native has run


class NativeUnavailable(RuntimeError):
    """The native ops could not be built or were disabled with PARTS_CSRC_FALLBACK=1."""


def cache_dir() -> Path:
    """Build directory: $PARTS_CSRC_CACHE or ~/.cache/parts/csrc-<torch>-py<major><minor>-<sources>,
    keyed by a hash of the sources too, so checkouts with different ops never rebuild each other's."""
    root = os.environ.get("PARTS_CSRC_CACHE") or Path.home() / ".cache" / "parts"
    here = Path(__file__).resolve().parent
    sources = hashlib.sha256(b"".join((here / s).read_bytes() for s in _SOURCES)).hexdigest()[:12]
    tag = f"csrc-{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}-{sources}"
    return Path(root) / tag.replace("+", "_")


def _compile() -> None:
    """Compile with ninja once per cache dir (an flock serialises concurrent builders) and load."""
    if os.environ.get("PARTS_CSRC_FALLBACK", "") not in ("", "0"):
        raise NativeUnavailable("PARTS_CSRC_FALLBACK is set")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise NativeUnavailable("no C++ compiler found")
    from torch.utils import cpp_extension

    build = cache_dir()
    build.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).resolve().parent
    with _build_lock(build), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # compiler notes must not abort the build under -W error
        cpp_extension.load(
            name="parts_csrc", sources=[str(here / s) for s in _SOURCES], build_directory=str(build),
            extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
            is_python_module=False, verbose=False)
    _register_fakes()


@contextmanager
def _build_lock(build: Path) -> Iterator[None]:
    """Hold an flock on the build dir; it dies with its process, unlike torch's FileBaton file.

    A builder killed mid-build leaves torch's ``lock`` file behind and every later load would
    wait on it forever; holding the flock we are the only builder, so such a file is stale.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on torch's FileBaton alone
        yield
        return
    with open(build / ".parts-build.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            (build / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _register_fakes() -> None:
    """Meta/fake kernels (FakeTensorMode, meta tensors) and the autograd formula of flatten."""

    @torch.library.register_fake("parts::flatten")
    def _flatten_fake(tensors):
        return tensors[0].new_empty(sum(t.numel() for t in tensors))

    def _flatten_setup(ctx, inputs, output):
        ctx.shapes = [t.shape for t in inputs[0]]

    def _flatten_backward(ctx, grad):
        return [g.view(s) for g, s in zip(grad.split([s.numel() for s in ctx.shapes]), ctx.shapes)]

    torch.library.register_autograd("parts::flatten", _flatten_backward, setup_context=_flatten_setup)

    @torch.library.register_fake("parts::copy_in")
    def _copy_in_fake(srcs, dst, offsets):
        return None

    @torch.library.register_fake("parts::copy_out")
    def _copy_out_fake(src, dsts, world_size, offsets, shard_numels):
        return None


def load_native() -> None:
    """Make torch.ops.parts available or raise NativeUnavailable (result cached per process)."""
    with _LOCK:
        if "ok" not in _STATE:
            try:
                _compile()
                _STATE["ok"] = True
            except Exception as e:  # no compiler, no ninja, compile error: fall back
                _STATE["ok"], _STATE["error"] = False, f"{type(e).__name__}: {e}"
    if not _STATE["ok"]:
        raise NativeUnavailable(str(_STATE["error"]))
