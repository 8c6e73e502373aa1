"""A tied parameter whose owner and borrower run in different stages (GPT-2's head shares the
token embedding: the embedding is in the first stage, the head in the last).

The owner's stage keeps the parameter's training state, sharded with the owner's unit, as in
a flat plan: the gradient norm and the checkpoint count it once. The borrower's stage holds a
copy in the compute dtype for the step only (`fetch`: an all-gather over the two stages' ranks
in which only the owners contribute), its head accumulates the parameter's fp32 gradient over
the step's micro-batches (a leaf hook, runtime/engine/unit_backward.py `UnitGrads.foreign`),
and after the backward `reduce` sends it to the owners (a reduce-scatter over the two stages'
ranks in which only the owners receive), who add it to their gradient shards before the
norm: the parameter's gradient is the sum of both uses, as in one process, and the owners'
update is the only one (the borrower gets the result at the next `fetch`). The cost model
charges the same bytes (`costmodel/stages.py`, tied embeddings)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cephalo.modeling.units import UnitModel
from cephalo.runtime.collectives.comm import Comm
from cephalo.runtime.engine.step_clock import StepClock
from cephalo.runtime.memory import MemoryLedger
from cephalo.runtime.pipeline.groups import StageGroups
from cephalo.runtime.state.flat import FlatLayout, overlap, shard_ranges
from cephalo.runtime.state.unit_shard import UnitShard


@dataclass(frozen=True)
class CrossTie:
    """A parameter of unit `borrower` (named `name` in its module) owned by unit `owner`
    (named `owner_name` there), the two units in different stages."""

    borrower: int
    name: str
    owner: int
    owner_name: str
    shape: tuple[int, ...]


def cross_stage_ties(model: UnitModel, groups: StageGroups) -> list[CrossTie]:
    """Every tied parameter whose owner (the first unit holding it) runs in another stage than
    a unit that uses it; the same list on every rank (from the model's structure)."""
    owner_of: dict[int, tuple[int, str]] = {}
    index_of = {u.name: i for i, u in enumerate(model.units)}
    for unit_name, pname, p in model.named_unit_parameters():
        owner_of[id(p)] = (index_of[unit_name], pname)
    out = []
    for i, unit in enumerate(model.units):
        for pname, p in unit.module.named_parameters():
            owner, owner_name = owner_of[id(p)]
            if owner != i and groups.stage_of_unit(owner) != groups.stage_of_unit(i):
                out.append(CrossTie(i, pname, owner, owner_name, tuple(p.shape)))
    return out


def owner_layout(model: UnitModel, owner: int) -> FlatLayout:
    """The owner unit's flat layout as `runtime/engine/setup.py` `build_shards` makes it (its
    own trained parameters, in `named_unit_parameters` order)."""
    name = model.units[owner].name
    params = [(pn, p) for un, pn, p in model.named_unit_parameters() if un == name]
    return FlatLayout(name, [(pn, p) for pn, p in params if p.requires_grad])


@dataclass
class StageTie:
    """One `CrossTie` on a rank of the owner's or the borrower's stage. Given the tie, the comm
    of the two stages' ranks, this rank's global rank, the owner's layout and the owner stage's
    state fractions (in its ranks' order), the owner's shard on an owner rank (None on a
    borrower), the ledger, device, compute dtype and the step's clock."""

    tie: CrossTie
    comm: Comm
    owner_ranks: list[int]
    members: list[int]
    """The comm's ranks: both stages', ascending global ranks."""
    owner_shard: UnitShard | None
    ledger: MemoryLedger
    device: torch.device
    dtype: torch.dtype
    clock: StepClock
    sizes: list[int] = field(default_factory=list)
    """Per member: its elements of the parameter (an owner's piece; 0 for a borrower)."""
    local: tuple[int, int] = (0, 0)
    """An owner: [lo, hi) of its piece, relative to its shard's start."""
    weight: torch.Tensor | None = None
    """The borrower's copy in the compute dtype (from `fetch` to the step's end)."""
    acc: torch.Tensor | None = None
    """The borrower's fp32 gradient of the parameter, accumulated over the micro-batches."""
    written: set[str] = field(default_factory=set)

    @classmethod
    def make(
        cls,
        tie: CrossTie,
        comm: Comm,
        layout: FlatLayout,
        owner_ranks: list[int],
        owner_fractions: list[float],
        members: list[int],
        owner_shard: UnitShard | None,
        ledger: MemoryLedger,
        device: torch.device,
        dtype: torch.dtype,
        clock: StepClock,
    ) -> StageTie:
        slot = layout.slot(tie.owner_name)
        ranges = shard_ranges(layout.numel, owner_fractions)
        piece = dict(zip(owner_ranks, ranges, strict=True))
        sizes = []
        for r in members:
            if r in piece:
                lo, hi = overlap(*piece[r], slot.offset, slot.numel)
                sizes.append(hi - lo)
            else:
                sizes.append(0)
        out = cls(tie, comm, owner_ranks, members, owner_shard, ledger, device, dtype, clock, sizes)
        if owner_shard is not None:
            lo, hi = overlap(owner_shard.start, owner_shard.size, slot.offset, slot.numel)
            out.local = (lo - owner_shard.start, hi - owner_shard.start)
        return out

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def fetch(self, train: bool) -> None:
        """The step's start: the borrower gets the owners' current weights (and, training, a
        gradient accumulator); the owners send their pieces."""
        us = self.owner_shard
        out = self.ledger.alloc("gathered", self.numel, self.dtype, device=self.device)
        lo, hi = self.local
        if us is not None:
            mine = self.ledger.alloc("gathered", hi - lo, self.dtype, device=self.device)
            mine.copy_(us.master[lo:hi])  # (host state is refused in a stage)
        else:
            mine = out[0:0]
        with self.clock.communication():
            self.comm.all_gather_v(out, mine, self.sizes)
        if us is not None:
            self.ledger.free(mine)
            self.ledger.free(out)
            return
        self.weight = out
        if train:
            self.acc = self.ledger.alloc(
                "grad_accum", self.numel, torch.float32, device=self.device
            )
            self.written = set()

    def params(self) -> dict[str, torch.Tensor]:
        """The borrower's view of the weight under its name in the borrowing unit."""
        assert self.weight is not None
        return {self.tie.name: self.weight.view(self.tie.shape)}

    def foreign(self) -> dict[str, tuple[torch.Tensor, set[str]]]:
        """The borrower's gradient accumulator as `UnitGrads.foreign` takes it."""
        assert self.acc is not None
        return {self.tie.name: (self.acc, self.written)}

    def reduce(self, device_grad: Callable[[UnitShard], torch.Tensor]) -> None:
        """After the backward: the borrower's gradient into the owners' gradient shards; the
        borrower's copy and accumulator go."""
        us = self.owner_shard
        lo, hi = self.local
        if us is not None:
            full = self.ledger.alloc("grad_accum", self.numel, torch.float32, device=self.device)
            full.zero_()
            part = self.ledger.alloc("grad_accum", hi - lo, torch.float32, device=self.device)
        else:
            assert self.acc is not None
            if self.tie.name not in self.written:  # the head never ran (a rank without rows)
                self.acc.zero_()
            full, part = self.acc, self.acc[0:0]
        with self.clock.communication():
            self.comm.reduce_scatter_v(part, full, self.sizes)
        if us is not None:
            device_grad(us)[lo:hi].add_(part)
            self.ledger.free(part)
            self.ledger.free(full)
        self.release()

    def release(self) -> None:
        """The borrower's copy (and an accumulator not reduced: evaluation, a failed step)."""
        if self.weight is not None:
            self.ledger.free(self.weight)
            self.weight = None
        if self.acc is not None and self.owner_shard is None:
            self.ledger.free(self.acc)
        self.acc = None
