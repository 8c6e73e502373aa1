"""Padded-even collectives: a unit whose split is near even (`costmodel.collectives.padded_even`)
is gathered and reduced with the even collectives (`all_gather_into_tensor` /
`reduce_scatter_tensor`) instead of grouped broadcasts / reduces of its exact sizes.

Layout. Every rank's piece of the unit is padded to `pad = max(sizes)` elements in the
buffers the collectives read and write, which are allocated padded once (no copy per call):
the fp32 shard buffer a gather sends from (the master and the host part's copy inside it),
the gathered unit (N x pad elements) and the unit's fp32 gradient (N x pad). Rank r's
elements lie at `offsets[r]` of its chunk: at the chunk's end for even r, at its start for
odd r, so two neighbours' elements touch and the unit is one contiguous run between the
padding of ranks 0 and 1, 2 and 3, ... With 2 ranks the whole unit is one view of the padded
buffer; with more, a parameter that straddles the padding between an odd and the next even
rank is copied out of the gathered buffer (`views`), and its gradient is added into its two
pieces (`slices`).

The padding never reaches the state: the optimizer, the gradient norm, the checkpoint and
`Engine.state_bytes` see the shard's own elements only (the master is a view inside the
padded buffer), and the padding's gradient is dropped when the reduce-scatter output is added
into the gradient shard. The cost model charges the padding's bytes and buffers wherever this
runs (`costmodel.collectives`: `CostModel.evaluate` and the planner, on a cluster whose
backend pads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cephalo.costmodel.collectives import padded_even
from cephalo.runtime.state.flat import FlatLayout


@dataclass(frozen=True)
class PaddedSplit:
    """Where each rank's elements of one unit lie in its padded buffers."""

    sizes: tuple[int, ...]
    """Elements per rank (the plan's split)."""
    pad: int
    """Every rank's padded chunk: max(sizes)."""

    @staticmethod
    def of(sizes: list[int]) -> PaddedSplit | None:
        """The padded layout of a near-even split (None: keep the grouped collectives)."""
        if not padded_even(sizes):
            return None
        return PaddedSplit(tuple(sizes), max(sizes))

    @property
    def world_size(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        """Elements of the padded unit buffers (gathered, gradient)."""
        return self.pad * len(self.sizes)

    def offset(self, rank: int) -> int:
        """Where rank's elements start within its chunk (see the module docstring)."""
        return self.pad - self.sizes[rank] if rank % 2 == 0 else 0

    def runs(self) -> list[tuple[int, int, int]]:
        """Contiguous runs (logical lo, logical hi, padded lo) of the unit in a padded buffer."""
        out: list[tuple[int, int, int]] = []
        start = 0
        for r, n in enumerate(self.sizes):
            at = r * self.pad + self.offset(r)
            if n and out and out[-1][2] + (out[-1][1] - out[-1][0]) == at:
                out[-1] = (out[-1][0], start + n, out[-1][2])
            elif n:
                out.append((start, start + n, at))
            start += n
        return out

    def slices(self, buf: torch.Tensor, lo: int, hi: int) -> list[torch.Tensor]:
        """Views of a padded buffer holding the unit's logical elements [lo, hi), in order."""
        out = []
        for a, b, at in self.runs():
            x, y = max(a, lo), min(b, hi)
            if x < y:
                out.append(buf[at + x - a : at + y - a])
        return out

    def views(
        self, layout: FlatLayout, buf: torch.Tensor, alloc
    ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """Each parameter of `layout` as a view of the padded gathered `buf`; a parameter that
        straddles padding is copied into a buffer from `alloc(numel)` (returned second, for the
        caller to free)."""
        views: dict[str, torch.Tensor] = {}
        copies: list[torch.Tensor] = []
        for s in layout.slots:
            pieces = self.slices(buf, s.offset, s.end)
            if len(pieces) <= 1:
                views[s.name] = (pieces[0] if pieces else buf[0:0]).view(s.shape)
                continue
            whole = alloc(s.numel)
            torch.cat(pieces, out=whole)
            copies.append(whole)
            views[s.name] = whole.view(s.shape)
        return views, copies
