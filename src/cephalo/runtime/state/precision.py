"""Precision policy: compute dtype for gathered parameters and activations; fp32 for
gradient accumulation, reduction, master weights and optimizer state; a dynamic loss scaler
for fp16 (bf16 and fp32 need none)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cephalo.errors import CephaloError

COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def compute_dtype(name: str) -> torch.dtype:
    """The torch dtype for a plan/config dtype name."""
    if name not in COMPUTE_DTYPES:
        raise CephaloError(f"compute dtype {name!r} is not one of {', '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[name]


@dataclass
class DynamicLossScaler:
    """fp16 loss scaling: multiply the loss gradient by `scale`; on a non-finite gradient
    skip the step and multiply the scale by `backoff_factor`; after `growth_interval`
    consecutive good steps multiply it by `growth_factor` (GradScaler's policy)."""

    scale: float = 2.0**16
    """Current loss scale."""
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 200
    """Good steps in a row before the scale grows."""
    min_scale: float = 1.0
    """The scale never drops below this (a run that needs less is diverging anyway)."""
    good_steps: int = 0
    """Consecutive finite steps since the last change."""

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, d: dict[str, float | int]) -> None:
        self.scale = float(d["scale"])
        self.good_steps = int(d["good_steps"])
