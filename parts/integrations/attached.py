"""What an integration checks of a model the user attached before handing it over."""

from __future__ import annotations

from typing import Optional

from torch import nn

from parts.partition import MixedPrecision
from parts.partition.coordinator import FetchCoordinator


def check_attached_precision(module: nn.Module, coordinator: FetchCoordinator, policy: Optional[MixedPrecision],
                             asked: str, way_out: str) -> None:
    """Raise ``ValueError`` where ``module``'s coordinator would compute in another dtype than ``policy``
    (the ``asked`` precision); the message ends with ``way_out``."""
    have = coordinator.mixed_precision
    if policy is not None and (have is None or have.param_dtype != policy.param_dtype):
        raise ValueError(f"{asked} but {type(module).__name__} is attached with mixed_precision={have!r}, so it "
                         f"would compute in {'fp32' if have is None else have.param_dtype}; {way_out}")
