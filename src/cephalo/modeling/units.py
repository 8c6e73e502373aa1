"""The contract between a model and the engine: a model is a list of units.

    units[0]        kind "embedding": module(input_ids: LongTensor[b, s]) -> hidden [b, s, h]
    units[1:-1]     kind "block":     module(hidden) -> hidden
    units[-1]       kind "head":      module(hidden, labels: LongTensor[b, s]) -> loss_sum

`loss_sum` is the SUM of the per-token cross-entropy over the labels that are not
`IGNORE_INDEX` (a 0-dim fp32 tensor). The engine divides by the global token count, so the
gradient is that of the mean over all tokens of the global batch, whatever the plan.
`labels` are already shifted: labels[:, t] is the target of position t.

Tied weights (GPT-2's wte / lm_head) are the same `nn.Parameter` object in two units; the
engine detects them by identity (the first unit owns the parameter; later units borrow it).

Units are built on the `meta` device by default and materialised by the engine (or by
`UnitModel.materialize`) with `reset_parameters` semantics: `init_weights(generator)` must
initialise every parameter of the model deterministically from the generator, so that the
single-process reference and every rank of a sharded run start from the same weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from cephalo.models import ModelSpec

IGNORE_INDEX = -100


@dataclass
class Unit:
    """One schedulable piece of the model."""

    name: str
    """Stable, unique name, used as the prefix of its parameters in checkpoints (e.g. `blocks.3`)."""
    kind: str
    """`embedding`, `block` or `head`."""
    module: nn.Module


class UnitModel(nn.Module):
    """A model as units. Subclasses fill `self.units` (an nn.ModuleList mirror is kept for
    `named_parameters`) and implement `init_weights`."""

    def __init__(self, spec: ModelSpec, units: list[Unit]):
        super().__init__()
        self.spec = spec
        self.unit_list = units
        # register so that .to(), .parameters(), state_dict() see everything once
        self.unit_modules = nn.ModuleDict({u.name.replace(".", "_"): u.module for u in units})

    @property
    def units(self) -> list[Unit]:
        return self.unit_list

    def init_weights(self, generator: torch.Generator) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def named_unit_parameters(self) -> Iterator[tuple[str, str, nn.Parameter]]:
        """(unit name, parameter name within the unit, parameter), each parameter once
        (a tied parameter is reported under the first unit that holds it)."""
        seen: set[int] = set()
        for u in self.units:
            for pname, p in u.module.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                yield u.name, pname, p

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Single-process reference: the MEAN token loss over the batch (the engine's target)."""
        h = self.units[0].module(input_ids)
        for u in self.units[1:-1]:
            h = u.module(h)
        loss_sum = self.units[-1].module(h, labels)
        n_tokens = (labels != IGNORE_INDEX).sum().clamp(min=1)
        return loss_sum / n_tokens

    def materialize(self, device: torch.device | str, generator: torch.Generator) -> UnitModel:
        """Allocate real storage for a meta-built model and initialise it from `generator`."""
        self.to_empty(device=device)
        self.init_weights(generator)
        return self
