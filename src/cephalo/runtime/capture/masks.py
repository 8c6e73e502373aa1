"""Per-sample dropout masks as inputs of a compiled block.

`SampleDropout` (runtime/dropout.py) draws each mask from small per-sample generators seeded
from Python ints: a loop a compiler cannot trace (a graph break per dropout call) and a CUDA
graph cannot replay (the seeds change every step). So a compiled block draws nothing: the
masks of a (block type, input shape) call are recorded once, eagerly (`MaskRecorder`: which
dropout calls, in which order, of which shape and keep probability), then drawn before each
call outside the graph with the very generators `SampleDropout` uses (`draw_masks`) and
replayed inside it (`GivenMasks`). The arithmetic around the mask (`input * mask / keep`, the
spelled-out attention of SDPA with dropout) is `SampleDropout`'s own: a compiled block drops
exactly what the eager engine drops, in its forward and in its recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cephalo.runtime.dropout import SampleDropout


@dataclass(frozen=True)
class MaskSpec:
    """One dropout call of a block: the shape and dtype of its mask, its keep probability."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    keep: float


class MaskRecorder(SampleDropout):
    """`SampleDropout` of the same key that also records each mask's `MaskSpec` in call order:
    the first (eager) call of a block type at an input shape."""

    def __init__(self, of: SampleDropout):
        super().__init__(of.seed, of.step, of.unit, of.sample_offset)
        self.specs: list[MaskSpec] = []

    def _mask(self, like: torch.Tensor, keep: float) -> torch.Tensor:
        self.specs.append(MaskSpec(tuple(like.shape), like.dtype, keep))
        return super()._mask(like, keep)


def draw_masks(
    dropout: SampleDropout, specs: tuple[MaskSpec, ...], device: torch.device
) -> list[torch.Tensor]:
    """The masks `dropout` would draw for calls 0, 1, ... of a unit whose calls are `specs`."""
    return [dropout.draw(i, s.shape, s.dtype, device, s.keep) for i, s in enumerate(specs)]


class GivenMasks(SampleDropout):
    """`SampleDropout` whose masks are given, in call order (inside a compiled block: the
    mode holds no generator and its key is not used)."""

    def __init__(self, masks: list[torch.Tensor]):
        super().__init__(0, 0, 0, 0)
        self.masks = masks

    def _mask(self, like: torch.Tensor, keep: float) -> torch.Tensor:
        mask = self.masks[self.calls]
        self.calls += 1
        return mask
