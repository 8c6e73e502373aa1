"""A unit's parameters as one flat buffer, and the uneven shard layout over ranks.

Each unit owns the parameters it holds first (a tied parameter belongs to the first unit
holding it, see `UnitModel.named_unit_parameters`). `FlatLayout` lays them out, in a fixed
order, in one 1-D buffer; rank i owns the contiguous piece `shard_ranges(numel, fractions)[i]`
of it. The same layout serves the fp32 master, the gradient and the AdamW moments.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from cephalo.errors import CephaloError
from cephalo.planner.plan import largest_remainder


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its unit's flat buffer."""

    name: str
    """Name within the unit's module (e.g. `attn.c_attn.weight`)."""
    shape: torch.Size
    offset: int
    """First element in the flat buffer."""
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class FlatShard:
    """This rank's piece of one logical tensor: elements [offset, offset + local.numel()) of
    the flattened tensor `name` (the checkpoint contract: `cephalo.train.checkpoint` saves and
    loads lists of these in the logical layout, so a checkpoint written under one plan loads
    under any other plan or world size). The pieces of all ranks tile each tensor exactly."""

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


class FlatLayout:
    """The parameters a unit owns, each at a fixed offset of one flat buffer."""

    def __init__(self, unit_name: str, named_params: Iterable[tuple[str, torch.Tensor]]):
        self.unit_name = unit_name
        slots: list[ParamSlot] = []
        offset = 0
        for name, p in named_params:
            slots.append(ParamSlot(name, p.shape, offset, p.numel()))
            offset += p.numel()
        self.slots = slots
        self.numel = offset
        self._by_name = {s.name: s for s in slots}
        self._numels = [s.numel for s in slots]

    def slot(self, name: str) -> ParamSlot:
        return self._by_name[name]

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each parameter as a view (with its shape) into `flat` (a whole unit buffer)."""
        if flat.numel() != self.numel:
            raise CephaloError(
                f"unit {self.unit_name}: flat buffer has {flat.numel()} elements, layout needs {self.numel}"
            )
        # one split call instead of a slice per parameter: this runs for every unit gathered
        if not self.slots:
            return {}
        pieces = flat.split(self._numels)
        return {s.name: piece.view(s.shape) for s, piece in zip(self.slots, pieces, strict=True)}

    def flatten(
        self, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Copy whole tensors (by name) into a new flat buffer in this layout."""
        flat = torch.empty(self.numel, dtype=dtype)
        for s in self.slots:
            flat[s.offset : s.end].copy_(tensors[s.name].detach().reshape(-1))
        return flat

    def segments_where(
        self, predicate: Sequence[bool], start: int, size: int
    ) -> list[tuple[int, int]]:
        """Runs [a, b) of the shard [start, start+size), relative to `start`, covered by the
        slots whose entry in `predicate` is true (adjacent runs merged)."""
        runs: list[tuple[int, int]] = []
        for s, keep in zip(self.slots, predicate, strict=True):
            if not keep:
                continue
            a, b = max(s.offset, start), min(s.end, start + size)
            if a >= b:
                continue
            if runs and runs[-1][1] == a - start:
                runs[-1] = (runs[-1][0], b - start)
            else:
                runs.append((a - start, b - start))
        return runs


def shard_ranges(numel: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous (start, size) per rank covering [0, numel), sizes proportional to the
    (normalised) fractions. Rounding is largest-remainder (ties to the lower rank), so the
    sizes sum exactly to `numel` and every rank computes the same layout."""
    if numel < 0:
        raise CephaloError(f"cannot shard {numel} elements")
    if not fractions:
        raise CephaloError("shard_ranges needs at least one fraction")
    if any(not math.isfinite(f) or f < 0 for f in fractions):
        raise CephaloError(f"state fractions must be finite and >= 0, got {list(fractions)}")
    total = math.fsum(fractions)
    if total <= 0:
        raise CephaloError(
            f"state fractions {list(fractions)} sum to 0; at least one rank must hold state"
        )
    sizes = largest_remainder(numel, fractions)
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, size))
        start += size
    return ranges


def overlap(a_start: int, a_size: int, b_start: int, b_size: int) -> tuple[int, int]:
    """Intersection [lo, hi) of two ranges (lo == hi when empty)."""
    lo, hi = max(a_start, b_start), min(a_start + a_size, b_start + b_size)
    return (lo, hi) if lo < hi else (lo, lo)
