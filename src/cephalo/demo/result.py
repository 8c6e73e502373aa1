"""The values of one `cephalo demo` run: its options, each training run read back, and
everything the report shows (`DemoResult`). Plain data, shared by the pipeline and the report."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from cephalo.costmodel.model import CostModel
from cephalo.costmodel.results import PlanEvaluation
from cephalo.errors import PlanDoesNotFit
from cephalo.planner.plan import Plan
from cephalo.specs.catalog.devices import CPU_DEFAULT_MEMORY_BYTES
from cephalo.specs.cluster import Cluster
from cephalo.specs.profile import MeasuredProfiles
from cephalo.train.config import JobConfig

STRATEGIES = ("cephalo", "even", "proportional")
# Steps of the first (warm-up) steps left out of measured step times: allocator, caches, gloo pairs.
WARMUP_STEPS_EXCLUDED = 2


@dataclass
class DemoOptions:
    """What `cephalo demo` runs."""

    out: Path = Path("runs/demo")
    """Report and run directories."""
    minutes: float = 1.25
    """Training budget of the cephalo run (the baseline run and profiling come on top)."""
    quick: bool = False
    """A tiny model and a few steps (tests, smoke checks): the same pipeline in well under a minute."""
    baseline_steps: int = 10
    """Steps of the comparison run (its throughput is what counts, not its loss)."""


@dataclass
class RunSummary:
    """One training run of the demo, read back from its metrics."""

    strategy: str
    run_dir: Path
    steps: int
    wall_s: float
    """Launch to exit, including worker start-up and the final checkpoint."""
    step_s: float
    """Median step time without the warm-up steps."""
    mean_step_s: float
    """Mean step time without the warm-up steps (the per-rank busy and idle means add up to it)."""
    samples_per_s: float
    losses: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)
    busy_s: list[float] = field(default_factory=list)
    """Per rank: mean compute seconds per step (emulated slowdown included)."""
    idle_s: list[float] = field(default_factory=list)
    """Per rank: mean seconds per step spent waiting (collectives, slower ranks)."""
    peak_bytes: list[int] = field(default_factory=list)
    """Per rank: the memory ledger's peak over the run."""
    time_split: list[dict[str, float]] = field(default_factory=list)
    """Per rank: mean seconds per step of each part of runtime/step_timing.py's split."""


@dataclass
class CalibrationEvent:
    """One calibration of the throttled run (a `calibration` record of its metrics.jsonl, and
    the `replan` record of the switch it led to)."""

    step: int
    """Steps done when it calibrated."""
    predicted_compute_s: list[float]
    """Per rank: the compute the cost model predicted for the running plan, before this refit."""
    measured_compute_s: list[float]
    """Per rank: the median measured compute over the steps this calibration read."""
    predicted_gain: float | None
    """The re-made plan's predicted speedup over the running one (None: not re-planned)."""
    decision: str
    """`re-planned`, `confirming` (a first sighting of a gain) or `kept`."""
    why_not: str
    batches: list[int]
    """The running plan's batches."""
    micro_batches: list[int] = field(default_factory=list)
    """The running plan's micro-batch sizes."""
    new_batches: list[int] | None = None
    """The plan switched to (re-planned only)."""
    new_micro_batches: list[int] | None = None
    replan_s: float | None = None
    """Calibration and re-planning, seconds (re-planned only)."""
    switch_s: float | None = None
    """The switch: engine, state re-layout, plan file, seconds (re-planned only)."""
    staged: list[int] = field(default_factory=list)
    """The ranks whose state waited in host memory during the switch (re-planned only)."""

    def ratios(self) -> list[float | None]:
        """Per rank: measured / predicted compute (None: a rank with no samples, no compute)."""
        return [
            m / p if p > 0 else None
            for m, p in zip(self.measured_compute_s, self.predicted_compute_s, strict=True)
        ]


@dataclass
class ThrottleRun:
    """The demo's re-planning run: a device throttles mid-run, calibration sees it, re-plans."""

    run_dir: Path
    rank: int
    """The rank that throttles."""
    at_step: int
    """It computes `slowdown` times slower than its profile from this step on."""
    slowdown: float
    wall_s: float
    step_s: dict[int, float] = field(default_factory=dict)
    """Measured step time per step."""
    events: list[CalibrationEvent] = field(default_factory=list)

    @property
    def switches(self) -> list[CalibrationEvent]:
        return [e for e in self.events if e.decision == "re-planned"]

    def median_step_s(self, first: int, last: int) -> float | None:
        """Median measured step over steps first..last (None: none in the run)."""
        xs = [s for k, s in self.step_s.items() if first <= k <= last]
        return statistics.median(xs) if xs else None


@dataclass
class DemoResult:
    """Everything the report needs."""

    options: DemoOptions
    cluster: Cluster
    config: JobConfig
    measured: MeasuredProfiles
    cost_model: CostModel
    plans: dict[str, Plan | PlanDoesNotFit]
    evaluations: dict[str, PlanEvaluation]
    memory_note: str
    ideal_samples_per_s: float
    runs: dict[str, RunSummary] = field(default_factory=dict)
    comparison: str | None = None
    """The baseline the cephalo run is compared with (`even`, else `proportional`), None if none fits."""
    timings_s: dict[str, float] = field(default_factory=dict)
    throttle: ThrottleRun | None = None
    """The re-planning run (None: not run)."""


def describe_cluster(cluster: Cluster) -> str:
    """`cpu, cpu:slowdown=1.5, ... (32 MiB)`: memory shown only where it is not the default."""
    return ", ".join(
        d.type_key
        + (
            f" ({d.memory_bytes / 2**20:.0f} MiB)"
            if d.memory_bytes != CPU_DEFAULT_MEMORY_BYTES
            else ""
        )
        for d in cluster.devices
    )
