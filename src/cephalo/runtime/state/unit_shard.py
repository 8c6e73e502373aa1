"""One unit on one rank (`UnitShard`: its flat layout, its shard range, its state slices and
the tied parameters it borrows), which units train and are gathered by the backward
(`trains`, `backward_gathers`), and one micro-batch of a step (`MicroBatch`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cephalo.runtime.collectives.padded import PaddedSplit
from cephalo.runtime.state.flat import FlatLayout, ParamSlot
from cephalo.runtime.state.host_state import HostGroup


@dataclass
class Borrow:
    """A parameter a unit uses but another unit owns (tied weights)."""

    name: str
    """Name within the borrowing unit's module."""
    owner: UnitShard
    slot: ParamSlot
    """The parameter's place in the owner's layout."""
    sizes: list[int]
    """Per rank: how much of the parameter lies in that rank's shard of the owner."""
    local: tuple[int, int]
    """[lo, hi) of this rank's part, relative to the owner's shard start."""


class UnitShard:
    """One unit on this rank: its layout, its shard range, and the state slices."""

    def __init__(
        self, index: int, unit, layout: FlatLayout, ranges: list[tuple[int, int]], rank: int
    ):
        self.index = index
        self.unit = unit
        self.layout = layout
        self.ranges = ranges
        self.sizes = [size for _, size in ranges]
        self.start, self.size = ranges[rank]
        self.borrows: list[Borrow] = []
        self.decay_segments: list[tuple[int, int]] = []
        self.host_n = 0
        """Elements of the shard kept on the host (its last ones)."""
        self.dev_n = self.size
        """Elements of the shard whose state is on the device (its first ones)."""
        # device part [0, dev_n) of the shard
        self.master: torch.Tensor
        self.grad: torch.Tensor
        self.exp_avg: torch.Tensor
        self.exp_avg_sq: torch.Tensor
        self.param_buf: torch.Tensor | None = None
        self.padded: PaddedSplit | None = None
        """A near-even split: the unit's collectives run padded-even (runtime/collectives/padded.py)."""
        self.pad_offset = 0
        """Padded-even: where this rank's elements start in its padded chunk."""
        self.send_buf: torch.Tensor | None = None
        """Padded-even, fp32: the padded chunk the gathers send, `param_buf` inside it."""
        """fp32 compute: one device buffer [master | host part's copy] of the whole shard."""
        self.host_copy: torch.Tensor
        """Device, compute dtype: the host part's parameters, for the all-gathers."""
        self.host: HostGroup | None = None
        """Host part [dev_n, size): master, gradient and moments in host memory."""
        self.host_upload: torch.Tensor | None = None
        """Host, compute dtype (not fp32): the updated host part, cast for its upload."""
        self.host_grad_written = False
        """The host gradient received a piece this step (later pieces are added to it)."""


def trains(us: UnitShard) -> bool:
    """The unit has trained parameters (a LoRA unit may have only frozen ones)."""
    return us.layout.numel > 0 or bool(us.borrows)


def backward_gathers(shards: list[UnitShard], u: int) -> bool:
    """Whether the backward gathers unit u (not the head: its backward ran in the forward;
    not a frozen embedding: nothing to compute)."""
    return 0 <= u < len(shards) - 1 and (u > 0 or trains(shards[0]))


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    sample_offset: int
    """Index of its first sample in the global batch."""
    position_ids: torch.Tensor | None = None
    """Per-document positions of packed samples (None: 0, 1, ... in every row)."""
    rng: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    """Generator states saved before each unit's forward, by unit index."""
    ref_logps: torch.Tensor | None = None
    """DPO: each row's reference log-probability (fp32 [rows]): precomputed (full fine-tuning)
    or from the adapters-off forward of this step (LoRA); None: the SFT objective."""
