"""Density schedule: dense for the first steps, then a geometric warm-up down to the target density.

DGC warms up over 25% -> 6.25% -> 1.56% -> 0.4% -> 0.1%; ``DensitySchedule(density=0.001,
warmup_steps=N, warmup_start=0.25)`` decays geometrically over N steps the same way, per step.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DensitySchedule:
    density: float
    dense_steps: int = 1
    warmup_steps: int = 0
    warmup_start: float = 0.25

    def __post_init__(self) -> None:
        if not (0.0 < self.density <= 1.0):
            raise ValueError(f"density must be in (0, 1], got {self.density!r}")
        if not isinstance(self.dense_steps, int) or self.dense_steps < 0:
            raise ValueError(f"dense_steps must be an int >= 0, got {self.dense_steps!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if not (0.0 < self.warmup_start <= 1.0):
            raise ValueError(f"warmup_start must be in (0, 1], got {self.warmup_start!r}")

    def density_at(self, step: int) -> float:
        """Density used for exchange number ``step`` (0-based); 1.0 means dense all-reduce."""
        if step < self.dense_steps:
            return 1.0
        s = step - self.dense_steps
        if s >= self.warmup_steps or self.warmup_start <= self.density:
            return self.density
        frac = s / self.warmup_steps
        return self.warmup_start * (self.density / self.warmup_start) ** frac
