"""parts.parallel: the data-parallel x tensor-parallel grid and a minimal tensor-parallel layer set."""

from parts.parallel._collectives import copy_to_tp, reduce_from_tp
from parts.parallel.clip import clip_grad_norm_2d, grad_norm_2d
from parts.parallel.grid import ParallelGrid
from parts.parallel.layers import (ColumnParallelLinear, RowParallelLinear, mark_tp_split,
                                   shard_tensor, tp_split, unshard_tensor)
from parts.parallel.layout import GridLayout, tp_ranges
from parts.parallel.state import tp_full_state_dict, tp_slice_state_dict

__all__ = ["ParallelGrid", "GridLayout", "tp_ranges", "ColumnParallelLinear", "RowParallelLinear",
           "copy_to_tp", "reduce_from_tp", "shard_tensor", "unshard_tensor", "tp_split",
           "mark_tp_split", "grad_norm_2d", "clip_grad_norm_2d", "tp_full_state_dict",
           "tp_slice_state_dict"]
