"""What one training step's forward hands to its backward (`StepState`).

The forward pass (runtime/engine/step_passes.py) makes one, the head pass and the fused tail
(runtime/engine/head_pass.py, runtime/engine/tail_pass.py) fill it as they start collectives the backward
must finish, and the backward consumes it. Nothing of it outlives the step: a step that raises
drops it with its frame instead of leaving stale handles on the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cephalo.runtime.engine.unit_comm import Gathered, Reduce


@dataclass
class StepState:
    """The collectives and gathered units in flight between a step's forward and backward."""

    head_reducing: list[Reduce] = field(default_factory=list)
    """The head's reduce-scatters, started at the end of the forward (the head pass, or the
    fused tail once the head's last micro-batch is through); the backward finishes them
    during the next unit's backward."""
    tail_reducing: list[Reduce] | None = None
    """The last block's reduce-scatters, started by the fused tail after the last block's
    backward ran in the head's pass (None: the tail is not fused, the backward runs the last
    block itself)."""
    kept_last: tuple[Gathered, dict[str, torch.Tensor]] | None = None
    """Unfused with `fused_tail_possible`: the last block as gathered in the forward, with its parameter
    views, for its backward (not gathered again)."""
    backward_prefetch: Gathered | None = None
    """The backward's first gather, started during the head pass so it overlaps it (unfused:
    the last block; fused: the block before it)."""
