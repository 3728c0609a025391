"""Many small tensors in one collective: pack them into a flat buffer, move it, unpack.

Every collective has a fixed cost (on gloo over loopback tens of µs of host time per call,
whatever its size), so a group of small all-gathers or reduce-scatters costs more in calls
than in bytes: a 32-layer model has hundreds of small parameters. ``split_small`` picks the
pairs worth packing (chunks of at most ``PACK_NUMEL`` elements, at least two of them);
``PackedAllGather`` / ``PackedReduceScatter`` move them in one collective over a flat
buffer and copy the results into the caller's tensors when it is done. The bytes on the
wire are exactly the bytes of the separate collectives (the chunks are laid side by side,
no padding is added), and every element goes through the same additions in the same rank
order, so the results are bitwise those of the separate collectives.

Layouts, for chunks ``c_0..c_k`` of ``n_0..n_k`` elements (``N`` their sum) over ``w`` ranks:
the all-gather sends ``cat(c_i)`` and receives ``w`` rows of ``N``; row ``r`` holds rank
``r``'s chunks side by side, and ``out_i.view(w, n_i)`` gets columns ``[o_i, o_i + n_i)``.
The reduce-scatter sends ``w`` rows of ``N`` (row ``r``, columns of chunk ``i``: rank ``r``'s
chunk of ``in_i``) and receives ``N``: this rank's reduced chunks side by side.
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional, Sequence

import torch

PACK_NUMEL = 1 << 18
"""Chunks (per-rank elements) up to this size are packed with the others of their call: the
copies in and out cost less than a collective's fixed cost up to about 1 MiB of fp32."""


def split_small(chunk_numels: Sequence[int], dtypes: Sequence[Hashable],
                limit: int = PACK_NUMEL) -> tuple[list[int], list[int]]:
    """``(packed, direct)`` indices: chunks of at most ``limit`` elements of the most common
    small dtype (or dtype pair) go in one packed collective if there are at least two, the rest direct."""
    small = [i for i, n in enumerate(chunk_numels) if 0 < n <= limit]
    if len(small) < 2:
        return [], list(range(len(chunk_numels)))
    counts: dict[Hashable, int] = {}
    for i in small:
        counts[dtypes[i]] = counts.get(dtypes[i], 0) + 1
    dtype = max(counts, key=lambda d: (counts[d], str(d)))
    packed = [i for i in small if dtypes[i] == dtype]
    if len(packed) < 2:
        return [], list(range(len(chunk_numels)))
    chosen = set(packed)
    return packed, [i for i in range(len(chunk_numels)) if i not in chosen]


class PackedAllGather:
    """All-gather of chunks ``ins`` (1-D) into ``outs`` (1-D, ``w * len(in)`` each) as one flat
    collective: ``send``/``recv`` are the buffers to move, ``finish()`` unpacks."""

    def __init__(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], world: int) -> None:
        self.outs, self.world = list(outs), world
        self.numels = [t.numel() for t in ins]
        self.send = torch.cat([t.reshape(-1) for t in ins])
        self.recv = torch.empty(world * self.send.numel(), dtype=self.send.dtype, device=self.send.device)

    def finish(self) -> None:
        """Copy every rank's chunk of every tensor from the flat receive buffer into ``outs``."""
        rows = self.recv.view(self.world, -1)  # one native copy into every out (no Python loop)
        torch.split_with_sizes_copy(rows, self.numels, dim=1,
                                    out=[out.view(self.world, n) for out, n in zip(self.outs, self.numels)])
        self.recv = self.send = None


class PackedReduceScatter:
    """Reduce-scatter of ``ins`` (1-D, ``w * len(out)`` each) into ``outs`` as one flat
    collective: ``send``/``recv`` (``ins``' and ``outs``' dtypes) are the buffers to move,
    ``finish()`` unpacks."""

    def __init__(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], world: int) -> None:
        self.outs = list(outs)
        self.numels = [t.numel() for t in outs]
        total = sum(self.numels)
        first = ins[0]
        send = torch.empty(world, total, dtype=first.dtype, device=first.device)
        torch.cat([t.view(world, n) for t, n in zip(ins, self.numels)], dim=1, out=send)
        self.send = send.view(-1)
        self.recv = torch.empty(total, dtype=outs[0].dtype, device=first.device)

    def finish(self) -> None:
        """Copy this rank's reduced chunk of every tensor into ``outs``."""
        torch.split_with_sizes_copy(self.recv, self.numels, out=self.outs)
        self.recv = self.send = None


class FinishAfter:
    """A handle whose ``wait()`` waits for ``work``, then runs ``finish`` (once)."""

    def __init__(self, work: object, finish: Callable[[], None]) -> None:
        self._work: Optional[object] = work
        self._finish = finish

    def wait(self) -> bool:
        """Wait for the collective, then unpack."""
        if self._work is not None:
            work, self._work = self._work, None
            work.wait()
            self._finish()
        return True
