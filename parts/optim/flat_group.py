"""One param group's replicated parameters packed into a flat, padded buffer."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from parts.csrc import copy_in

from .layout import GroupLayout, chunk_ranges


class FlatGroup:
    """Flat model-dtype buffer (params are views of it), fp32 grad buffer, fp32 master partition."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 world_size: int, rank: int, grad_dtype: torch.dtype, step_chunk: int,
                 param_dtype: Optional[torch.dtype] = None) -> None:
        self.params = list(params)
        self.names = list(names)
        self.layout = GroupLayout(tuple(p.numel() for p in params), world_size)
        self.rank, self.world_size = rank, world_size
        dtype, device = param_dtype or params[0].dtype, params[0].device
        size = self.layout.padded_numel
        self.flat = torch.zeros(size, dtype=dtype, device=device)
        n = self.layout.partition_numel
        self.master = self._master_from(params, n)  # the values as given, before any cast
        if dtype == params[0].dtype:
            copy_in([p.detach() for p in params], self.flat, self.layout.offsets)  # no packed temporary
        else:
            for p, off in zip(self.params, self.layout.offsets):  # the cast to ``param_dtype``
                self.flat.narrow(0, off, p.numel()).copy_(p.detach().reshape(-1))
        for p, off in zip(self.params, self.layout.offsets):
            p.data = self.flat.narrow(0, off, p.numel()).view(p.shape)
        self.grad = torch.zeros(size, dtype=grad_dtype, device=device)
        if world_size == 1 and grad_dtype == torch.float32:
            self.part_grad = self.grad  # nothing to scatter: step reads the buffer itself
        else:
            self.part_grad = torch.zeros(n, dtype=torch.float32, device=device)
        self.master.grad = self.part_grad
        self.chunks = chunk_ranges(n, step_chunk)
        self.master_chunks = []  # what the wrapped optimizer steps: views of the master
        for start, length in self.chunks:
            view = self.master.narrow(0, start, length)
            view.grad = self.part_grad.narrow(0, start, length)
            self.master_chunks.append(view)
        self.versions = self._versions()

    def _master_from(self, params: Sequence[torch.Tensor], n: int) -> torch.Tensor:
        """This rank's fp32 master partition, read from the params themselves (padding zero)."""
        master = torch.zeros(n, dtype=torch.float32, device=params[0].device)
        for pc in self.layout.pieces(self.rank):
            piece = params[pc.index].detach().reshape(-1)[pc.start:pc.stop]
            master.narrow(0, pc.offset, pc.stop - pc.start).copy_(piece)
        return master

    def _versions(self) -> list[int]:
        """Every param's version counter: a write through the param (``load_state_dict``,
        ``nn.init``, ``p.copy_``) bumps it; the write-back into the flat buffer does not."""
        return [p._version for p in self.params]

    def _check_views(self) -> None:
        """Raise naming a param whose data was replaced (``p.data = ...``, ``model.to(...)``)."""
        base, size = self.flat.data_ptr(), self.flat.element_size()
        for p, name, off in zip(self.params, self.names, self.layout.offsets):
            if p.numel() and (p.data_ptr() != base + off * size or p.dtype != self.flat.dtype):
                raise RuntimeError(
                    f"BF16Optimizer: parameter {name!r} no longer lives in the optimizer's flat "
                    f"buffer (its data was replaced, e.g. by `p.data = ...` or `model.to(...)` "
                    f"after the optimizer was built); move or cast the model first, then build "
                    f"the optimizer")

    def refresh_master(self) -> list[str]:
        """Re-read this rank's master from params written since the last write-back; their names.

        The master caches the params in fp32: a param loaded after the optimizer was built
        (``model.load_state_dict``) would otherwise be overwritten by the stale master."""
        self._check_views()
        now = self._versions()
        changed = {i for i, (a, b) in enumerate(zip(now, self.versions)) if a != b}
        self.versions = now
        if not changed:
            return []
        base = self.rank * self.layout.partition_numel
        for pc in self.layout.pieces(self.rank):
            if pc.index in changed:
                n = pc.stop - pc.start
                self.master.narrow(0, pc.offset, n).copy_(self.flat.narrow(0, base + pc.offset, n))
        return [self.names[i] for i in sorted(changed)]

    def mark_written(self) -> None:
        """Record that master and params agree (after the write-back)."""
        self.versions = self._versions()

    def grad_view(self, index: int) -> torch.Tensor:
        """The fp32 grad-buffer view of parameter ``index``."""
        p = self.params[index]
        return self.grad.narrow(0, self.layout.offsets[index], p.numel()).view(p.shape)

    def make_hook(self, index: int, on_grad: Callable[[], None]) -> Callable:
        """Post-accumulate-grad hook: add the model-dtype grad into the fp32 buffer and drop it."""
        view = self.grad_view(index)

        def hook(param: torch.Tensor) -> None:
            view.add_(param.grad)
            param.grad = None
            on_grad()

        return hook

    def real_numel(self) -> int:
        """Real (unpadded) elements of this rank's partition."""
        start, stop = self.layout.shard.range(self.rank)
        return stop - start

    def zero_padding(self) -> None:
        """Keep the master's padding at zero so it never reaches params, norms or checkpoints."""
        real = self.real_numel()
        if real < self.master.numel():
            self.master.narrow(0, real, self.master.numel() - real).zero_()
