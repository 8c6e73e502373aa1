"""The engine's training state as pieces of logical tensors (the checkpoint contract).

The engine shards every unit's flat buffer unevenly, so a rank's state is not a set of whole
tensors but, per logical tensor, one contiguous range of its flattened elements. `FlatShard`
names such a range; `cephalo.train.checkpoint` saves and loads lists of them in the logical
layout, so a checkpoint written under one plan loads under any other plan or world size.
This module holds only the value type, so the engine and the checkpoint code can both
import it without importing each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlatShard:
    """This rank's piece of one logical tensor: elements [offset, offset + local.numel()) of
    the flattened tensor `name`. The pieces of all ranks tile each tensor exactly."""

    name: str
    """Logical name: `<unit>.<param>`, `optim.exp_avg.<unit>.<param>`, `optim.exp_avg_sq.<unit>.<param>`."""
    global_shape: tuple[int, ...]
    """Shape of the whole logical tensor (a `torch.Size` is fine)."""
    offset: int
    """First element of `local` within the flattened logical tensor."""
    local: torch.Tensor
    """Live 1-D view into the rank's state (possibly empty): loading a checkpoint writes it in place."""

    @property
    def global_numel(self) -> int:
        return math.prod(self.global_shape)

    @property
    def end(self) -> int:
        """One past the last element this piece covers."""
        return self.offset + self.local.numel()
