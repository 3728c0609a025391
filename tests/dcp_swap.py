"""A small sharded model saved to and loaded from a DCP folder, and a save killed during the swap
that puts its files in place, shared by the DCP folder tests (no tests here)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch


def _model(seed: int) -> torch.nn.Module:
    from parts.partition import partitioned
    torch.manual_seed(seed)
    with partitioned():
        return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 3))


def save_as(path: str, seed: int) -> None:
    """Save the model built with ``seed`` to ``path`` through ``parts.comm.dcp``."""
    from parts.comm import dcp
    from parts.partition import sharded_state_dict
    dcp.save({"model": sharded_state_dict(_model(seed))}, checkpoint_id=path)


def load_as(path: str, seed: int) -> bool:
    """Whether ``path`` loads into a fresh model as the weights of a model built with ``seed``."""
    from parts.comm import dcp
    from parts.partition import full_state_dict, load_sharded_state_dict, sharded_state_dict
    model = _model(1000)
    state = {"model": sharded_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    load_sharded_state_dict(model, state["model"])
    want = full_state_dict(_model(seed), rank0_only=False)
    return all(torch.equal(v, want[k]) for k, v in full_state_dict(model, rank0_only=False).items())


@contextlib.contextmanager
def killed_after(renames: int, swap_move: Callable[[str, str], bool],
                 kills_removal: Callable[[str, int], bool]) -> Iterator[None]:
    """This process's save stops after ``renames`` renames for which ``swap_move(src, dst)`` holds, or,
    once they are done, at a removal for which ``kills_removal(path, renamed)`` holds, as a killed
    process would: no clean-up runs."""
    import parts.comm.dcp_files as files
    real = (files.os.rename, files.shutil.rmtree, files._recover, files.abandon)
    count = [0]

    def rename(src, dst):
        if not swap_move(src, dst):
            return real[0](src, dst)
        if count[0] >= renames:
            raise OSError("killed")
        count[0] += 1
        return real[0](src, dst)

    def rmtree(path, ignore_errors=False):
        if count[0] >= renames and kills_removal(path, count[0]):
            raise OSError("killed")
        real[1](path, ignore_errors=ignore_errors)
    files.os.rename, files.shutil.rmtree = rename, rmtree
    files._recover, files.abandon = (lambda target: None), (lambda staging: None)
    try:
        yield
    finally:
        files.os.rename, files.shutil.rmtree, files._recover, files.abandon = real
