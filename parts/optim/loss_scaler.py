"""Dynamic loss scaling for fp16 training (pure bookkeeping; overflow is agreed by the caller).

BF16Optimizer decides overflow from the global grad norm, which is all-reduced
(a non-finite value on any rank makes it inf everywhere), so every rank calls
``update`` with the same flag and the scales never diverge.
"""

from __future__ import annotations

from typing import Any


class DynamicLossScaler:
    """Scale that backs off after ``hysteresis`` consecutive overflows and grows after
    ``growth_interval`` clean steps."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000,
                 hysteresis: int = 1, min_scale: float = 1.0) -> None:
        if init_scale <= 0 or min_scale <= 0:
            raise ValueError(f"init_scale and min_scale must be > 0, got {init_scale}, {min_scale}")
        if growth_factor < 1 or not 0 < backoff_factor <= 1:
            raise ValueError(f"need growth_factor >= 1 and 0 < backoff_factor <= 1, got "
                             f"{growth_factor}, {backoff_factor}")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(f"growth_interval and hysteresis must be >= 1, got "
                             f"{growth_interval}, {hysteresis}")
        self.scale = float(max(init_scale, min_scale))
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
        self.min_scale = float(min_scale)
        self.good_steps = 0
        self.hysteresis_left = self.hysteresis
        self.overflows = 0

    def update(self, overflow: bool) -> None:
        """Record one step's outcome (the same ``overflow`` on every rank) and adjust the scale."""
        if overflow:
            self.overflows += 1
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                self.hysteresis_left = self.hysteresis
            return
        self.hysteresis_left = self.hysteresis
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (plain numbers)."""
        return dict(vars(self))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()``."""
        unknown = set(state) - set(vars(self))
        if unknown:
            raise KeyError(f"DynamicLossScaler.load_state_dict: unknown keys {sorted(unknown)}")
        vars(self).update(state)
