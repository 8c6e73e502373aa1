"""The collectives of a step as the cost model charges them, and the padded-even rule.

Ring cost per collective: (n-1)/n x bytes / link + latency. Every unit is all-gathered in its
compute dtype (forward and backward) and its fp32 gradient reduce-scattered once.

Padded-even (runtime/collectives/padded.py). A unit whose split is near even, max(sizes) x N <=
PAD_EVEN_SLACK x sum(sizes), is gathered and reduced with the even collectives
(`all_gather_into_tensor` / `reduce_scatter_tensor`) on buffers padded to N x max(sizes): the
padding travels too. The runtime does this where its comm gathers equal sizes with the even
collective (`Comm.even_gather`): on NCCL, not on gloo. The cost model cannot see the backend,
so it reads the devices (`backend_pads`): the runtime picks NCCL on CUDA GPUs and gloo on CPUs
(runtime/collectives/dist.py), so a cluster of GPUs pads and one of CPUs (emulated devices included) does
not; `CostModel(padded_collectives=...)` overrides it: the trainer's automatic plan passes its
comm's `even_gather` (exactly what its engine does), a replan of a job forced onto gloo False.

A padded split is described by its largest state fraction u (the runtime's pad, per unit, is
u x the unit's trained elements); `pad` = 0 means the split runs unpadded. Its charge is made
in the cost model only (the time by `Collectives` here, the memory by `CostModel._phases` and
`CostModel.padding_bytes_per_fraction`), and every consumer reads it from `CostModel`:
  time    every collective of a unit's trained part moves N x u of it instead of all of it
          (`collective_factor`); the frozen base of an adapter run is gathered unpadded
          (runtime/state/frozen.py) and the latency does not stretch
  memory  the gathered units and the full fp32 unit gradients are N x u of the trained part
          (`CostModel._phases`); the reduce-scatter output is u of the largest unit, not s
          (every rank receives a whole padded chunk), and in fp32 the shard buffer a gather
          sends from (the master inside it) is u of the model, not s: (u - s) x
          `CostModel.padding_bytes_per_fraction` more than unpadded; with more than 2 ranks
          the unit computing also holds copies of the parameters that straddle padding
          (runtime/collectives/padded.py `views`), bounded by (N-1) // 2 of its largest
          (`CostModel.straddle_params`)
Not charged, padded or not: the transient compute-dtype chunk a gather sends in fp16 / bf16
(its shard, or its padded chunk).
An exactly even split (u = 1/N) pays nothing: N x u = 1. The rule is decided on the plan's
fractions; the runtime decides it per unit on whole elements, which agrees away from the
threshold (the planner keeps `SKEW_MARGIN` past it, `least_unpadded_fraction`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PAD_EVEN_SLACK = 1.15
"""A unit's shards are padded to equal size, and its collectives run as the even ones
(`all_gather_into_tensor` / `reduce_scatter_tensor`: NCCL's ring, tree and NVLS algorithms),
where the padding adds at most this factor to the bytes they move; a more skewed split keeps
the grouped broadcasts / reduces of its exact sizes (runtime/collectives/padded.py)."""
SKEW_MARGIN = 1e-3
"""A plan meant to run unpadded keeps its largest fraction this much (relative) past the
threshold: the runtime rounds each unit's split to whole elements and decides per unit, and a
unit of more than N / SKEW_MARGIN elements then rounds to the same side."""


def padded_even(sizes: Sequence[float]) -> bool:
    """Whether a split of `sizes` (elements or fractions per rank of one shard group) runs
    padded-even: max(sizes) x N <= PAD_EVEN_SLACK x sum(sizes), over 2 ranks or more."""
    sizes = [float(n) for n in sizes]
    total = sum(sizes)
    return len(sizes) > 1 and total > 0 and max(sizes) * len(sizes) <= PAD_EVEN_SLACK * total


def collective_factor(sizes: Sequence[float]) -> float:
    """Bytes a unit's all-gather or reduce-scatter moves over the bytes of its unit: N x
    max(sizes) / sum(sizes) padded-even (the padding travels too), else 1."""
    sizes = [float(n) for n in sizes]
    return len(sizes) * max(sizes) / sum(sizes) if padded_even(sizes) else 1.0


def split_padding(fractions: Sequence[float], enabled: bool) -> float:
    """The `pad` of a split of state fractions (summing to 1): its largest fraction where it
    runs padded-even on a backend that pads (`enabled`), else 0."""
    if not enabled or not padded_even(fractions):
        return 0.0
    return max(float(f) for f in fractions) / sum(float(f) for f in fractions)


def pad_factor(pad, world: int):
    """The bytes factor of a split padded to `pad` over `world` ranks (1: unpadded); broadcasts."""
    if np.ndim(pad):
        pad = np.asarray(pad, dtype=np.float64)
        return np.where(pad > 0, world * pad, 1.0)
    return world * pad if pad > 0 else 1.0


def least_unpadded_fraction(world: int) -> float:
    """The smallest largest-fraction a split the planner means to run unpadded keeps: just
    past the padded-even threshold (`SKEW_MARGIN`)."""
    return PAD_EVEN_SLACK * (1.0 + SKEW_MARGIN) / world


def backend_pads(device_types: Sequence[str]) -> bool:
    """Whether the runtime pads near-even splits on these devices: CUDA GPUs train over NCCL,
    whose `Comm.even_gather` is on; CPUs (emulated devices too) over gloo, where it is off."""
    return bool(device_types) and all(t != "cpu" for t in device_types)


@dataclass(frozen=True)
class Collectives:
    """Per unit kind, the time of one all-gather and one reduce-scatter over `world` ranks,
    and the part of each that padding stretches (its trained bytes, without the latency)."""

    world: int
    latency_s: float
    gather_s: dict[str, float]
    scatter_s: dict[str, float]
    gather_padded_s: dict[str, float]
    """Per kind: the seconds of the trained part of a gather (what N x u multiplies)."""
    scatter_padded_s: dict[str, float]

    @staticmethod
    def ring(
        world: int,
        bytes_per_s: float,
        latency_s: float,
        gather_bytes: dict[str, float],
        padded_gather_bytes: dict[str, float],
        scatter_bytes: dict[str, float],
    ) -> Collectives:
        """Ring collectives: (n-1)/n x bytes / link + latency (none on one rank)."""
        ring = (world - 1) / world if world > 1 else 0.0
        latency = latency_s if world > 1 else 0.0
        return Collectives(
            world=world,
            latency_s=latency,
            gather_s={k: ring * b / bytes_per_s + latency for k, b in gather_bytes.items()},
            scatter_s={k: ring * b / bytes_per_s + latency for k, b in scatter_bytes.items()},
            gather_padded_s={k: ring * b / bytes_per_s for k, b in padded_gather_bytes.items()},
            scatter_padded_s={k: ring * b / bytes_per_s for k, b in scatter_bytes.items()},
        )

    def gather(self, kind: str, pad=0.0):
        """One all-gather of a unit of `kind` under a split padded to `pad` (0: unpadded)."""
        extra = pad_factor(pad, self.world) - 1.0
        return self.gather_s[kind] + extra * self.gather_padded_s[kind]

    def scatter(self, kind: str, pad=0.0):
        """One reduce-scatter of a unit of `kind`'s fp32 gradient under a split padded to `pad`."""
        extra = pad_factor(pad, self.world) - 1.0
        return self.scatter_s[kind] + extra * self.scatter_padded_s[kind]
