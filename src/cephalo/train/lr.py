"""Learning-rate schedule: linear warmup, then cosine decay to `min_lr` (or constant).

The learning rate of a step is a pure function of the step index, so a resumed run uses
exactly the rates the uninterrupted run would have used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cephalo.errors import CephaloError

SCHEDULES = ("cosine", "constant")


@dataclass(frozen=True)
class LRSchedule:
    """Warmup + cosine (or constant) learning rate, indexed by the 0-based step."""

    peak_lr: float
    """Rate at the end of the warmup."""
    min_lr: float
    """Rate of the last step under `cosine`."""
    warmup_steps: int
    """Steps 0 .. warmup_steps-1 ramp linearly up to `peak_lr` (step w-1 uses `peak_lr`)."""
    total_steps: int
    """Steps of the whole run; the last one (total_steps - 1) uses `min_lr` under `cosine`."""
    kind: str = "cosine"
    """`cosine` or `constant` after the warmup."""

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise CephaloError(
                f"unknown lr schedule {self.kind!r}; use one of {', '.join(SCHEDULES)}"
            )
        if self.total_steps < 1 or not 0 <= self.warmup_steps < max(self.total_steps, 1):
            raise CephaloError(
                f"lr schedule needs 0 <= warmup_steps ({self.warmup_steps}) < total_steps ({self.total_steps})"
            )
        if not 0 <= self.min_lr <= self.peak_lr:
            raise CephaloError(
                f"lr schedule needs 0 <= min_lr ({self.min_lr}) <= peak lr ({self.peak_lr})"
            )

    def __call__(self, step: int) -> float:
        if step < 0:
            raise CephaloError(f"lr schedule: step must be >= 0, got {step}")
        if step < self.warmup_steps:
            # (step + 1): the first step already learns; a zero rate would waste it
            return self.peak_lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.peak_lr
        decay_steps = self.total_steps - 1 - self.warmup_steps
        progress = 1.0 if decay_steps <= 0 else min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_lr + 0.5 * (self.peak_lr - self.min_lr) * (
            1.0 + math.cos(math.pi * progress)
        )
