"""What the cost model answers: one rank's verdict (`RankCost`, its memory by category in
`MemoryBreakdown`) and a whole plan's (`PlanEvaluation`). Values only: the formulas that fill
them live in `costmodel.py`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from cephalo.costmodel.host import host_shortfall_message

MEMORY_CATEGORIES = (
    "state",
    "gathered",
    "grad_accum",
    "activations",
    "boundary",
    "logits",
    "reserve",
)


@dataclass
class MemoryBreakdown:
    """Device memory of one rank by category at its predicted peak, bytes (compare with the
    runtime ledger's `at_peak_by_category`, where `activations` here also holds the ledger's
    `grad_transient` and `boundary` its `staging`)."""

    state: int = 0
    """Owned shard of fp32 master weights, gradients and Adam moments."""
    gathered: int = 0
    """Gathered compute-dtype parameters: current unit + prefetched unit."""
    grad_accum: int = 0
    """Full fp32 gradient buffers of two units and one reduce-scatter output."""
    activations: int = 0
    """One unit's recompute + backward activations at the micro-batch size."""
    boundary: int = 0
    """Layer-boundary activations still held (staging buffers when offloaded)."""
    logits: int = 0
    """The head's recompute + backward for one micro-batch (at least its fp32 logits); 0
    unless the peak falls in the head's backward."""
    reserve: int = 0
    """Kept free for fragmentation and workspaces."""

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in MEMORY_CATEGORIES)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class RankCost:
    """The cost model's verdict on one rank of a plan."""

    rank: int
    device: str
    step_s: float
    """This rank's time for one step, its collectives included (the step is the max of these)."""
    compute_s: float
    """Forward + recompute + backward kernel time (busy time without the optimizer); on a
    device without async copies, the host copies too (they run on the compute thread)."""
    optimizer_s: float
    comm_s: float
    """Total collective time (mostly hidden under compute)."""
    host_copy_s: float
    """Total boundary-activation copy time to and from the host (0 without offload)."""
    memory: MemoryBreakdown
    capacity_bytes: int
    host_state_s: float = 0.0
    """Host-state time: the host AdamW, the uploads of the updated parameters and the gradient
    copies to the host (on a GPU mostly beside other work; the step time says what shows)."""
    host_bytes: int = 0
    """Host memory of this rank: host state and offloaded boundary activations."""
    node: int = 0
    host_capacity_bytes: int | None = None
    """Host memory of this rank's node (shared with the node's other ranks); None: unknown."""
    fused_tail: bool = False
    """Whether this rank runs the fused tail: the last block's forward, the head's pass and
    the last block's backward at once, no recompute (costmodel/rules.py)."""

    @property
    def busy_s(self) -> float:
        return self.compute_s + self.optimizer_s

    @property
    def peak_bytes(self) -> int:
        return self.memory.total

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity_bytes

    @property
    def shortfall_bytes(self) -> int:
        return max(0, self.memory.total - self.capacity_bytes)


@dataclass
class PlanEvaluation:
    """A whole plan through the cost model."""

    ranks: list[RankCost]
    global_batch_size: int
    seq_len: int
    step_s: float = field(init=False)
    samples_per_s: float = field(init=False)
    tokens_per_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.step_s = max(r.step_s for r in self.ranks)
        self.samples_per_s = self.global_batch_size / self.step_s if self.step_s > 0 else math.inf
        self.tokens_per_s = self.samples_per_s * self.seq_len

    def host_by_node(self) -> dict[int, tuple[int, int | None, list[int]]]:
        """Per node: (host bytes its ranks use, its host memory or None, its ranks)."""
        out: dict[int, tuple[int, int | None, list[int]]] = {}
        for r in self.ranks:
            used, cap, ranks = out.get(r.node, (0, r.host_capacity_bytes, []))
            out[r.node] = (used + r.host_bytes, cap, [*ranks, r.rank])
        return out

    @property
    def host_fits(self) -> bool:
        """Every node's host memory holds what its ranks put there."""
        return all(cap is None or used <= cap for used, cap, _ in self.host_by_node().values())

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks) and self.host_fits

    def host_shortfall_message(self) -> str | None:
        """One line per node whose host memory is too small for the plan, or None."""
        return host_shortfall_message(
            {
                node: (cap, [(r.rank, r.host_bytes) for r in self.ranks if r.node == node])
                for node, (_, cap, _ranks) in self.host_by_node().items()
            }
        )
