"""``ShardView``: a tensor of a global shape with no storage, pointing at the pieces of it this
rank holds, for ``torch.distributed.checkpoint`` (DCP) to save from and load into.

``ShardView(shape, segments)`` holds ``segments`` of ``(flat_start, 1-D tensor)`` (a flat
shard of a parameter is one segment). DCP sees each segment as at most ``2 * ndim - 1``
row-aligned boxes (``parts.base.boxes``), each a view of the segment: saving writes the
views, loading copies straight into them, nothing is copied on the way and no rank ever
holds another rank's piece. Any DCP planner and storage writer/reader works on it (it
speaks DCP's checkpointable protocol, as DTensor does); any other op on it raises, naming it.

A segment may also be *deferred*: an object that is not a tensor and has ``numel()``,
``dtype``, ``device``, ``materialize()`` (a 1-D tensor of its elements, read now; writes
into it are kept) and ``settle()`` (give back what ``materialize`` lent, writing back what
was written): ``parts.offload.lease.Stored``, a tensor in a ``DiskStore``. Its boxes are
materialized only when DCP asks for them (``__get_tensor_shard__``: the writer saving one
item, the reader loading one), so a save or load holds one stored tensor at a time.
``settle(state)`` settles every deferred segment of a state dict.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from parts._compat import default_torch_function, storage_less_tensor
from parts.base.boxes import flat_boxes


def is_deferred(piece: Any) -> bool:
    """True for a deferred segment (not a tensor; read when DCP asks: see the module docstring)."""
    return not isinstance(piece, torch.Tensor) and hasattr(piece, "materialize")


def same_piece(a: Any, b: Any) -> bool:
    """True if segments ``a`` and ``b`` are the same elements (same memory, or same stored range)."""
    if is_deferred(a) or is_deferred(b):
        return is_deferred(a) and is_deferred(b) and a.same_as(b)
    return a.numel() == b.numel() and (a.numel() == 0 or a.data_ptr() == b.data_ptr())


class _Deferred:
    """A box of a deferred segment: ``resolve()`` materializes the segment and views the box."""

    def __init__(self, piece: Any, lo: int, sizes: tuple) -> None:
        self.piece, self.lo, self.shape = piece, lo, torch.Size(sizes)

    def resolve(self) -> torch.Tensor:
        return self.piece.materialize().narrow(0, self.lo, self.shape.numel()).view(self.shape)


def _resolve(box: Any) -> torch.Tensor:
    return box.resolve() if isinstance(box, _Deferred) else box


def _properties(box: Any, dtype: torch.dtype) -> TensorProperties:
    if isinstance(box, _Deferred):
        return TensorProperties(dtype=dtype)
    return TensorProperties.create_from_tensor(box)


class ShardView(torch.Tensor):
    """A storage-less tensor of global ``shape`` whose pieces on this rank are ``segments`` (for DCP)."""

    _boxes: dict
    _segments: tuple
    _label: str
    holder: Optional[torch.Tensor]  # the tensor the segments are views of, if the maker says

    @staticmethod
    def __new__(cls, shape: Sequence[int], segments: Sequence[tuple[int, torch.Tensor]], *,
                dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None,
                name: str = "", holder: Optional[torch.Tensor] = None) -> "ShardView":
        segments = tuple((int(s), t) for s, t in segments)
        dtype = dtype or (segments[0][1].dtype if segments else torch.float32)
        device = device or (segments[0][1].device if segments else torch.device("cpu"))
        view = storage_less_tensor(cls, shape, dtype, device)
        view._segments, view._label, view.holder = segments, name, holder
        view._boxes = _boxes_of(tuple(shape), segments, name)
        return view

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        """Plain dispatch, no subclass wrapping (ops reach ``__torch_dispatch__``)."""
        return default_torch_function(func, types, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        """Only ``detach`` (what DCP does to state-dict values); any other op raises."""
        if getattr(func, "overloadpacket", None) is torch.ops.aten.detach and isinstance(args[0], ShardView):
            return args[0].rebuilt()
        view = next((a for a in args if isinstance(a, ShardView)), None)
        label = f" of {view._label!r}" if view is not None and view._label else ""
        raise RuntimeError(f"a ShardView{label} is a torch.distributed.checkpoint view of this rank's shard, "
                        f"not data: {func} is not supported on it (load it with dcp.load, then "
                        f"parts.partition.load_sharded_state_dict)")

    def rebuilt(self) -> "ShardView":
        """A new ShardView over the same segments."""
        return ShardView(self.shape, self._segments, dtype=self.dtype, device=self.device, name=self._label,
                         holder=self.holder)

    def __repr__(self) -> str:  # type: ignore[override]
        held = sum(t.numel() for _, t in self._segments)
        return f"ShardView({self._label!r}, shape={tuple(self.shape)}, {self.dtype}, {held} elements here, " \
               f"{len(self._boxes)} boxes)"

    def pieces(self) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """``(offsets, view)`` of every box this rank holds (deferred segments materialized)."""
        return [(off, _resolve(box)) for off, box in self._boxes.items()]

    @property
    def segments(self) -> tuple[tuple[int, torch.Tensor], ...]:
        """``(flat_start, 1-D tensor)`` of every piece of the global tensor this rank holds."""
        return self._segments

    # ------------------------------------------------ DCP's checkpointable protocol (as DTensor)
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        """One SHARD write item per box."""
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=view.shape),
                              properties=_properties(view, self.dtype), size=self.shape))
                for off, view in self._boxes.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """The boxes this rank holds (what it reads on load)."""
        return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=view.shape) for off, view in self._boxes.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The view of the box at ``index.offset`` (a deferred segment is materialized now)."""
        view = self._boxes.get(tuple(index.offset) if index.offset is not None else None)
        if view is None:
            raise ValueError(f"ShardView {self._label!r}: this rank holds no box at offset {index.offset} "
                             f"(it holds {list(self._boxes)})")
        return _resolve(view)


def _boxes_of(shape: tuple, segments: tuple, name: str) -> dict:
    """Offsets -> view of every box of every segment."""
    numel = 1
    for d in shape:
        numel *= d
    boxes: dict = {}
    for start, flat in segments:
        deferred = is_deferred(flat)
        if not deferred and flat.dim() != 1:
            raise ValueError(f"ShardView {name!r}: a segment must be a 1-D tensor, got shape {tuple(flat.shape)}")
        if numel == 0:  # an empty tensor: one empty box, so the key exists in the checkpoint
            boxes[(0,) * len(shape)] = torch.empty(shape, dtype=flat.dtype, device="cpu") if deferred else \
                flat.narrow(0, 0, 0).view(shape)
            continue
        for box in flat_boxes(shape, start, start + flat.numel()):
            lo = box.flat_start - start
            boxes[box.offsets] = _Deferred(flat, lo, box.sizes) if deferred else \
                flat.narrow(0, lo, box.numel).view(box.sizes)
    return boxes


def settle(state: Any) -> None:
    """Settle every deferred segment of the ShardViews in ``state`` (nested dicts and lists)."""
    if isinstance(state, ShardView):
        for _, piece in state.segments:
            if is_deferred(piece):
                piece.settle()
    elif isinstance(state, dict):
        for value in state.values():
            settle(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            settle(value)


def has_deferred(state: Any) -> bool:
    """True if some ShardView in ``state`` has a deferred segment."""
    if isinstance(state, ShardView):
        return any(is_deferred(piece) for _, piece in state.segments)
    if isinstance(state, dict):
        return any(has_deferred(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(has_deferred(v) for v in state)
    return False
