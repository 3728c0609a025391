"""A module that uses another module's weight where the coordinator cannot see it, shared by the
coordinator tests of external parameters (no tests here)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Hidden(nn.Module):
    """Uses another module's weight, kept where no read of ``module.weight`` reports it (not detectable)."""

    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self.lin = nn.Linear(other.out_features, other.in_features)
        self.__dict__["refs"] = [other.weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.lin(x), self.refs[0])
