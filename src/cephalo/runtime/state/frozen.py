"""The frozen base (LoRA / QLoRA): parameters that are gathered but never trained.

Each unit's frozen parameters (`requires_grad` False) sit in ONE flat buffer in the compute
dtype (fp32 on the CPU), sharded unevenly by the plan's state fractions like the trained
state, and all-gathered per unit per pass next to the unit's trained parameters. They get
no fp32 master, no gradient, no AdamW moments and are never reduce-scattered: a rank holds
its piece of the frozen buffer (ledger category `frozen`), and per pass the gathered unit
(`gathered`, as the trained parameters).

QLoRA: the parameters listed in `UnitModel.quantized_parameters` are stored as NF4 bytes
(runtime/nf4.py) inside that same float-typed buffer, every parameter's bytes starting on an
element boundary; the uneven-shard all-gather moves them unchanged, and they are
dequantized into compute-dtype weights (`frozen_dequant`) once the unit's gather completes,
freed with the gathered buffer.

Tied frozen weights (an untrained tied embedding / output head) are owned by the first unit
holding them; a later unit gathers the owner's element range of that parameter (a second,
smaller all-gather), as the engine does for trained tied weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from cephalo.modeling.nf4 import (
    DEQUANT_TRANSIENT_BYTES,
    Nf4Format,
    dequant_chunk,
    dequantize_into,
    nf4_format,
    quantize,
)
from cephalo.runtime.collectives.comm import Comm, Handle
from cephalo.runtime.device_memory import host_memory
from cephalo.runtime.memory import MemoryLedger
from cephalo.runtime.state.flat import overlap, shard_ranges

FROZEN = "frozen"
"""Ledger category: this rank's piece of the frozen base (compute dtype or NF4 bytes)."""
GATHERED = "gathered"
"""Ledger category of the gathered frozen units (the engine's, for trained parameters too)."""
DEQUANT = "frozen_dequant"
"""Ledger category: QLoRA's dequantized compute-dtype weights of a gathered unit."""


@dataclass(frozen=True)
class FrozenSlot:
    """Where one frozen parameter lives in its unit's buffer (elements of the buffer dtype)."""

    name: str
    shape: torch.Size
    offset: int
    numel: int
    nf4: Nf4Format | None = None
    """Stored as NF4 bytes (else as itself, in the buffer dtype)."""

    @property
    def end(self) -> int:
        return self.offset + self.numel


class FrozenLayout:
    """A unit's frozen parameters in one buffer of `dtype` (NF4 ones as bytes)."""

    def __init__(
        self,
        unit_name: str,
        named: Sequence[tuple[str, torch.Tensor]],
        dtype: torch.dtype,
        quantized: frozenset[str],
    ):
        self.unit_name, self.dtype = unit_name, dtype
        item = dtype.itemsize
        slots, offset = [], 0
        for name, p in named:
            fmt = nf4_format(p.shape) if f"{unit_name}.{name}" in quantized else None
            numel = p.numel() if fmt is None else -(-fmt.nbytes // item)
            # NF4 bytes hold fp32 pieces: start them 8-byte aligned
            if fmt is not None:
                offset = -(-offset * item // 8) * 8 // item
            slots.append(FrozenSlot(name, p.shape, offset, numel, fmt))
            offset += numel
        self.slots = slots
        self.numel = offset
        self._by_name = {s.name: s for s in slots}

    def slot(self, name: str) -> FrozenSlot:
        return self._by_name[name]

    def pack(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """A new CPU buffer holding `values` (fp32 tensors by name) in this layout."""
        flat = torch.zeros(self.numel, dtype=self.dtype)
        for s in self.slots:
            if s.nf4 is None:
                flat[s.offset : s.end].copy_(values[s.name].detach().reshape(-1))
            else:
                raw = quantize(s.nf4, values[s.name])
                flat[s.offset : s.end].view(torch.uint8)[: raw.numel()].copy_(raw)
        return flat

    @property
    def quantized(self) -> bool:
        return any(s.nf4 is not None for s in self.slots)


@dataclass
class _FrozenBorrow:
    name: str
    owner: FrozenUnit
    slot: FrozenSlot
    sizes: list[int]
    local: tuple[int, int]
    """[lo, hi) of this rank's part, relative to the owner's shard start."""


@dataclass
class FrozenUnit:
    """One unit's frozen parameters on this rank."""

    layout: FrozenLayout
    ranges: list[tuple[int, int]]
    shard: torch.Tensor
    """This rank's piece of the buffer (ledger category `frozen`)."""
    rank: int
    borrows: list[_FrozenBorrow] = field(default_factory=list)

    @property
    def sizes(self) -> list[int]:
        return [n for _, n in self.ranges]

    @property
    def start(self) -> int:
        return self.ranges[self.rank][0]

    @property
    def names(self) -> set[str]:
        return {s.name for s in self.layout.slots} | {b.name for b in self.borrows}


@dataclass
class FrozenGathered:
    """A unit's frozen parameters gathered (maybe still in flight)."""

    unit: FrozenUnit
    flat: torch.Tensor
    tied: list[torch.Tensor]
    handles: list[Handle]
    dequant: list[torch.Tensor] = field(default_factory=list)
    """QLoRA: the dequantized weights (ledger buffers), freed with the gathered unit."""


class FrozenBase:
    """Every unit's frozen parameters on this rank: built unit by unit, gathered per pass."""

    def __init__(
        self,
        comm: Comm,
        ledger: MemoryLedger,
        device: torch.device,
        dtype: torch.dtype,
        fractions: Sequence[float],
        quantized: frozenset[str] = frozenset(),
    ):
        self.comm, self.ledger, self.device, self.dtype = comm, ledger, device, dtype
        self.fractions = list(fractions)
        self.quantized = quantized
        self.units: dict[int, FrozenUnit] = {}

    def add_unit(
        self,
        index: int,
        unit_name: str,
        named: Sequence[tuple[str, torch.Tensor]],
        values: dict[str, torch.Tensor],
    ) -> None:
        """Keep this rank's piece of one unit's frozen parameters (`values`: fp32, by name)."""
        if not named:
            return
        layout = FrozenLayout(unit_name, named, self.dtype, self.quantized)
        ranges = shard_ranges(layout.numel, self.fractions)
        start, size = ranges[self.comm.rank]
        with host_memory():  # packed and quantized in host memory (runtime/device_memory.py)
            full = layout.pack(values)
        shard = self.ledger.alloc(FROZEN, size, self.dtype, device=self.device)
        shard.copy_(full[start : start + size])
        self.units[index] = FrozenUnit(layout, ranges, shard, self.comm.rank)

    def tie(self, index: int, name: str, owner_index: int, owner_name: str) -> None:
        """Unit `index` uses the frozen parameter `owner_name` of unit `owner_index` as `name`."""
        owner = self.units[owner_index]
        slot = owner.layout.slot(owner_name)
        pieces = [overlap(s, n, slot.offset, slot.numel) for s, n in owner.ranges]
        lo, hi = pieces[self.comm.rank]
        user = self.units.get(index)
        if user is None:  # a unit whose only frozen parameter is borrowed
            empty = FrozenLayout("", [], self.dtype, frozenset())
            user = self.units[index] = FrozenUnit(
                empty, shard_ranges(0, self.fractions), owner.shard[0:0], self.comm.rank
            )
        user.borrows.append(
            _FrozenBorrow(
                name, owner, slot, [b - a for a, b in pieces], (lo - owner.start, hi - owner.start)
            )
        )

    def names(self, index: int) -> set[str]:
        unit = self.units.get(index)
        return unit.names if unit is not None else set()

    def nbytes(self) -> int:
        """Bytes of this rank's pieces of the frozen base."""
        return sum(u.shard.numel() * u.shard.element_size() for u in self.units.values())

    def start_gather(self, index: int, async_op: bool) -> FrozenGathered | None:
        unit = self.units.get(index)
        if unit is None:
            return None
        flat = self.ledger.alloc(GATHERED, unit.layout.numel, self.dtype, device=self.device)
        handles = []
        if unit.layout.numel:
            handles.append(self.comm.all_gather_v(flat, unit.shard, unit.sizes, async_op=async_op))
        tied = []
        for b in unit.borrows:
            buf = self.ledger.alloc(GATHERED, b.slot.numel, self.dtype, device=self.device)
            tied.append(buf)
            lo, hi = b.local
            handles.append(
                self.comm.all_gather_v(buf, b.owner.shard[lo:hi], b.sizes, async_op=async_op)
            )
        return FrozenGathered(unit, flat, tied, handles)

    def params(self, g: FrozenGathered) -> dict[str, torch.Tensor]:
        """The gathered unit's frozen parameters (call once its handles completed): views of
        the gathered buffer, NF4 ones dequantized into ledger buffers (`frozen_dequant`, so
        that autograd saving them does not count them again as activations)."""
        pieces = [(s, g.flat[s.offset : s.end], s.name) for s in g.unit.layout.slots]
        pieces += [(b.slot, buf, b.name) for b, buf in zip(g.unit.borrows, g.tied, strict=True)]
        out = {}
        for slot, piece, name in pieces:
            if slot.nf4 is None:
                out[name] = piece.view(slot.shape)
                continue
            fmt = slot.nf4
            buf = self.ledger.alloc(DEQUANT, fmt.numel, self.dtype, device=self.device)
            # torchao's temporaries while it dequantizes (int64 codes, fp32 values)
            transient = DEQUANT_TRANSIENT_BYTES * dequant_chunk(fmt)
            self.ledger.charge(DEQUANT, transient)
            dequantize_into(fmt, piece.view(torch.uint8)[: fmt.nbytes], buf)
            self.ledger.release(DEQUANT, transient)
            g.dequant.append(buf)
            out[name] = buf.view(slot.shape)
        return out

    def release(self, g: FrozenGathered) -> None:
        self.ledger.free(g.flat)
        for buf in g.tied + g.dequant:
            self.ledger.free(buf)
        g.dequant = []

    @torch.no_grad()
    def full_state_dict(self, unit_names: Callable[[int], str]) -> dict[str, torch.Tensor]:
        """Every frozen parameter whole, fp32 on the CPU, by `<unit>.<param>` (NF4:
        dequantized), gathered on every rank (export)."""
        out = {}
        for index, unit in self.units.items():
            g = self.start_gather(index, async_op=False)
            assert g is not None
            prefix = unit_names(index)
            params = self.params(g)
            for s in unit.layout.slots:
                out[f"{prefix}.{s.name}"] = params[s.name].detach().float().cpu().clone()
            self.release(g)
        return out
