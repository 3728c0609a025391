"""Parameters a module returns as they are: a bias its caller adds (Megatron's
``skip_bias_add`` layers return ``(output, bias)``), a positional table read by the caller.

The caller uses such a parameter after the module's forward returned, when the module's
fetch would have released it, and reads it without going through ``module.bias`` (so no
``WatchedParameters`` read reports it). The coordinator makes it an external parameter of
the caller's fetch unit as the module returns, as ``register_external_parameter`` would:
it stays gathered while the caller runs, is fetched again for the caller's backward and in
every later step (DeepSpeed ZeRO-3 does the same with parameters found in forward outputs).
"""

from __future__ import annotations

from typing import Any

import torch

from parts.partition.coordinator.hooks import tensors_in
from parts.partition.coordinator.table import ParamTable


def returned_params(table: ParamTable, output: Any) -> list[int]:
    """Stable ids of the attached model's parameters found as they are in ``output``."""
    found = (table.pid(t) for t in tensors_in(output))
    return list(dict.fromkeys(pid for pid in found if pid is not None))


def backward_outputs(table: ParamTable, output: Any) -> list[torch.Tensor]:
    """The tensors of ``output`` whose grads mark the module's backward: all but returned
    parameters (a hook on a parameter outlives the step and fires in every later backward)."""
    return [t for t in tensors_in(output) if table.pid(t) is None]
