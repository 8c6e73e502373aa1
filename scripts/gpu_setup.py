"""What scripts/gpu_check.py's checks run on (`Setup`), in a module of its own so that the
check files (gpu_check.py, gpu_check_models.py, gpu_profile.py) import it without importing
each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Setup:
    """What the checks run on: the device, the comm, and model sizes for it."""

    device: torch.device
    comm: object
    big_model: str  # GPT-2 124M on a GPU, gpt-tiny on the CPU
    seq: int
    cuda: bool

    @property
    def low(self) -> str:
        return "bf16" if self.cuda else "fp32"
