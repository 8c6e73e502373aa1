"""Calibration: the cost model's coefficients refitted from the job that is running.

Every step, each rank's measurements (busy time, optimizer and host-state time, ledger peak)
are all-gathered by the trainer (`RankStats`); `StepLog` keeps them. `refit` compares their
medians (the first step under a plan excluded: it warms up and checks collectives) with what
the cost model predicts for the plan being run, rank by rank, and returns a cost model whose
coefficients match the measurements:

- compute, per device type: the profile's forward and backward times scaled by the median
  over that type's ranks of measured / predicted compute time, where the measured compute
  is the rank's own work outside the optimizer (its unit compute and the engine's per-step
  work around it: the step without collective waits, optimizer and host work), since the
  cost model has no term of its own for the engine's Python work;
- device optimizer speed, per device type: `optimizer_s_per_param` scaled the same way;
- host optimizer speed, per rank: the host's AdamW time per parameter scaled by measured /
  predicted host-state time (ranks with host state only);
- memory reserve: raised so that every rank's predicted peak covers its measured ledger peak
  (never lowered below the reserve the model had: the ledger does not see the allocator's
  fragmentation);
- synchronisation (`Calibration.sync_s`): the measured step beyond the refitted model's
  slowest rank, what every rank waits in collectives that no rank's own time explains
  (collectives taken as hidden that are not, per-step collectives, ranks meeting at every
  unit); added to every plan's predicted step (`predicted_step_s`), so it does not change
  the plan the planner picks, but it makes the predicted step and the gain of a re-plan true.

A staged plan (pipeline stages, costmodel/stages.py) is refitted the same way, rank by rank:
its predicted compute is the M micro-batches of its stage's units (`RankCost.compute_s`), its
measured work the step without the waits (a stage's receives of boundaries and gradients,
the bubble included, are waits: runtime/pipeline/stage_step.py times them as communication),
its optimizer its share of its stage's parameters. The profiles scaled per device type are
the ones the stage times are made of, so the cost model's stage times follow what ran; the
bubble, the crossings and the per-step overhead the refitted model predicts, and what it
still misses is `sync_s`, as for a flat plan.

On CUDA the step's waits and optimizer phase are the compute stream's, from CUDA events
(runtime/engine/step_clock.py): host clocks there would see ~0 s in collectives (a NCCL wait
orders streams) and charge the GPU's backlog to the optimizer. On the CPU they are host time.

Link bandwidths are not refitted: the time a rank waits in a collective mixes the link with
the other ranks' lateness (load imbalance), which the compute scale already explains.

All ranks hold the same gathered measurements, so every rank computes the same refit.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field, replace

from cephalo.costmodel.host import HostResources
from cephalo.costmodel.model import CostModel
from cephalo.planner.plan import Plan
from cephalo.specs.profile import Curve, DeviceProfile, UnitProfile

MIN_SCALE, MAX_SCALE = 0.05, 20.0
"""Bounds of a refitted coefficient's scale (a measurement outside them is noise or a stall)."""


@dataclass
class RankSample:
    """One rank's measurements of one step (seconds, bytes)."""

    busy_s: float
    optimizer_s: float
    host_s: float
    step_s: float
    peak_bytes: int
    comm_wait_s: float = 0.0

    @property
    def work_s(self) -> float:
        """The rank's own work outside the optimizer phase: unit compute plus the engine's
        per-step work around it (the step without waits, optimizer and host work)."""
        return max(self.busy_s, self.step_s - self.comm_wait_s - self.optimizer_s - self.host_s)

    @property
    def other_s(self) -> float:
        """The rest of the step: collectives not hidden and waits for the other ranks."""
        return max(0.0, self.step_s - self.work_s - self.optimizer_s - self.host_s)


@dataclass
class StepLog:
    """Per-step measurements of every rank since the plan now running started."""

    steps: list[list[RankSample]] = field(default_factory=list)
    since: int = 0
    """Calibrate from the steps since this index only (`mark` sets it at each calibration): a
    device that changed speed is seen as it is now, and two calibrations in a row read disjoint
    steps, so a gain one of them predicts is confirmed by independent measurements."""

    def add(self, ranks) -> None:
        """Record one step's `RankStats` (every rank's values)."""
        self.steps.append(
            [
                RankSample(b, o, h, s, p, w)
                for b, o, h, s, p, w in zip(
                    ranks.busy_s,
                    ranks.optimizer_s,
                    ranks.host_s,
                    ranks.step_s,
                    ranks.peak_bytes,
                    ranks.comm_wait_s,
                    strict=True,
                )
            ]
        )

    def clear(self) -> None:
        """A new plan: its measurements start afresh (the old plan's batches, micro-batches and
        shards are not the new one's, so they must not drive the new plan's fit)."""
        self.steps.clear()
        self.since = 0

    def mark(self) -> None:
        """A calibration read the steps so far: the next one reads only the steps after them."""
        self.since = len(self.steps)

    def usable(self) -> list[list[RankSample]]:
        """The steps calibration reads: those since the last `mark`, never the plan's first
        (warm-up) step."""
        return self.steps[max(1, self.since) :]

    def median(self, rank: int, attr: str) -> float:
        return statistics.median(getattr(s[rank], attr) for s in self.usable())

    def max_peak(self, rank: int) -> int:
        return max(s[rank].peak_bytes for s in self.usable())

    def job_step_s(self) -> float:
        """The median step of the job (a step ends when its slowest rank's does)."""
        return statistics.median(max(r.step_s for r in s) for s in self.usable())


@dataclass
class RankFit:
    """Predicted against measured for one rank (what a calibration logs)."""

    rank: int
    device: str
    predicted_step_s: float
    measured_step_s: float
    predicted_compute_s: float
    measured_compute_s: float
    predicted_peak_bytes: int
    measured_peak_bytes: int
    predicted_other_s: float = 0.0
    """The step beyond compute and optimizer: collectives not hidden, host work, the
    un-modelled synchronisation (`Calibration.sync_s`) and, measured, waits for other ranks."""
    measured_other_s: float = 0.0

    def line(self) -> str:
        return (
            f"rank {self.rank} ({self.device}): step {self.predicted_step_s:.3f} s predicted / "
            f"{self.measured_step_s:.3f} s measured, compute {self.predicted_compute_s:.3f} / "
            f"{self.measured_compute_s:.3f} s, collectives and waits {self.predicted_other_s:.3f} / "
            f"{self.measured_other_s:.3f} s, peak {self.predicted_peak_bytes / 2**20:.1f} / "
            f"{self.measured_peak_bytes / 2**20:.1f} MiB"
        )


@dataclass
class Calibration:
    """A refit: the new cost model and what changed."""

    cost_model: CostModel
    ranks: list[RankFit]
    compute_scale: dict[str, float]
    """Per device type: the factor its profile's compute times were multiplied by."""
    optimizer_scale: dict[str, float]
    host_optimizer_scale: dict[int, float]
    """Per rank with host state: the factor on its host's AdamW time per parameter."""
    reserve_bytes: int | None
    """The memory the new model holds back on every device beyond that device's own reserve
    (`CostModel.reserve_extra_bytes`; None: unchanged)."""
    sync_s: float = 0.0
    """Seconds per step that the refitted model leaves unexplained (`predicted_step_s`)."""

    def changes(self) -> list[str]:
        """What the refit changed, one phrase each (empty: nothing noticeable)."""
        out = [f"{k} compute x{v:.3f}" for k, v in self.compute_scale.items() if abs(v - 1) > 0.01]
        out += [
            f"{k} optimizer x{v:.3f}" for k, v in self.optimizer_scale.items() if abs(v - 1) > 0.01
        ]
        out += [
            f"rank {r} host optimizer x{v:.3f}"
            for r, v in self.host_optimizer_scale.items()
            if abs(v - 1) > 0.01
        ]
        if self.reserve_bytes is not None:
            out.append(f"memory reserve +{self.reserve_bytes / 2**20:.1f} MiB per device")
        if self.sync_s >= 0.0005:
            out.append(f"synchronisation {self.sync_s * 1e3:.0f} ms per step")
        return out

    def to_dict(self) -> dict:
        return {
            "compute_scale": self.compute_scale,
            "optimizer_scale": self.optimizer_scale,
            "host_optimizer_scale": {str(k): v for k, v in self.host_optimizer_scale.items()},
            "reserve_bytes": self.reserve_bytes,
            "sync_s": self.sync_s,
            "ranks": [vars(r) for r in self.ranks],
        }


def _clamp(x: float) -> float:
    return min(MAX_SCALE, max(MIN_SCALE, x))


def _ratio(measured: float, predicted: float) -> float | None:
    return _clamp(measured / predicted) if predicted > 0 and measured > 0 else None


def _scaled_curve(c: Curve, f: float) -> Curve:
    return Curve(list(c.xs), [y * f for y in c.ys])


def scaled_profile(p: DeviceProfile, compute: float, optimizer: float) -> DeviceProfile:
    """`p` with its forward / backward times x`compute` and its AdamW time x`optimizer`."""
    units = {
        k: UnitProfile(
            _scaled_curve(u.fwd_s, compute), _scaled_curve(u.bwd_s, compute), u.activation_bytes
        )
        for k, u in p.units.items()
    }
    out = copy.copy(p)
    out.units = units
    out.optimizer_s_per_param = p.optimizer_s_per_param * optimizer
    out.meta = {**p.meta, "calibrated": {"compute": compute, "optimizer": optimizer}}
    return out


def rebuilt(
    cm: CostModel,
    profiles: dict[str, DeviceProfile] | None = None,
    host: HostResources | None = None,
    reserve_extra_bytes: int | None = None,
) -> CostModel:
    """`cm` with other profiles, hosts or extra reserve (everything else as it was)."""
    return CostModel(
        cm.model,
        cm.seq_len,
        cm.dtype,
        cm.devices,
        profiles if profiles is not None else cm.profiles,
        cm.comm,
        reserve_bytes=cm.reserve_bytes,
        reserve_fraction=cm.reserve_fraction,
        reserve_extra_bytes=(
            reserve_extra_bytes if reserve_extra_bytes is not None else cm.reserve_extra_bytes
        ),
        meta=cm.meta,
        host=host if host is not None else cm.host,
        serial_reduce=cm.serial_reduce,
        adapter=cm.adapter,
        links=cm.links,
        cross_reduce=cm.cross_reduce,
        padded_collectives=cm.padded_collectives,
    )


def predicted_step_s(cm: CostModel, plan: Plan, sync_s: float = 0.0) -> float:
    """The step a calibrated model predicts for `plan`: the slowest rank's, and the
    synchronisation the refit measured beyond it (the same for every plan: it moves the step,
    not the planner's choice, and makes the predicted gains of re-planning honest)."""
    return cm.evaluate(plan).step_s + sync_s


def refit(cm: CostModel, plan: Plan, log: StepLog, sync_s: float = 0.0) -> Calibration:
    """The cost model refitted to `log`'s measurements of `plan` (see the module docstring);
    `sync_s`: the previous refit's, part of what the model predicted. `log` must hold at least
    two steps (the first is not read)."""
    if len(log.usable()) < 1:
        raise ValueError("calibration needs at least two measured steps")
    predicted = cm.evaluate(plan).ranks
    fits, compute_by_type, opt_by_type = [], {}, {}
    host_scale: dict[int, float] = {}
    excess = 0
    for r, pc in enumerate(predicted):
        busy = log.median(r, "work_s")
        fits.append(
            RankFit(
                r,
                pc.device,
                pc.step_s + sync_s,
                log.median(r, "step_s"),
                pc.compute_s,
                busy,
                pc.peak_bytes - pc.memory.reserve,
                log.max_peak(r),
                max(0.0, pc.step_s - pc.compute_s - pc.optimizer_s) + sync_s,
                log.median(r, "other_s"),
            )
        )
        if plan.ranks[r].batch_size > 0 and (f := _ratio(busy, pc.compute_s)) is not None:
            compute_by_type.setdefault(pc.device, []).append(f)
        rp = plan.ranks[r]
        if plan.staged:
            # a stage's rank updates its share of its stage's parameters only: the cost
            # model's own optimizer term (costmodel/stages.py; no host state in a stage)
            device_opt = pc.optimizer_s
        else:
            device_params = rp.state_fraction * (1 - rp.host_state_fraction) * cm.optimizer_params
            device_opt = device_params * cm.optimizer_s_per_param(pc.device)
        if (f := _ratio(log.median(r, "optimizer_s"), device_opt)) is not None:
            opt_by_type.setdefault(pc.device, []).append(f)
        if pc.host_state_s > 0 and (f := _ratio(log.median(r, "host_s"), pc.host_state_s)):
            host_scale[r] = f
        # bytes the measured peak needs beyond the predicted peak, reserve included
        excess = max(excess, log.max_peak(r) - pc.peak_bytes)
    compute = {k: statistics.median(v) for k, v in compute_by_type.items()}
    optimizer = {k: statistics.median(v) for k, v in opt_by_type.items()}
    profiles = {
        k: scaled_profile(p, compute.get(k, 1.0), optimizer.get(k, 1.0))
        for k, p in cm.profiles.items()
    }
    host = cm.host
    if host is not None and host_scale:
        speeds = tuple(s * host_scale.get(r, 1.0) for r, s in enumerate(host.optimizer_s_per_param))
        host = replace(host, optimizer_s_per_param=speeds)
    reserve = None
    if excess > 0:  # some rank's measured peak is above its predicted peak with the reserve:
        # every device's own reserve grows by that much (one absolute reserve for all, the
        # largest device's share, left a mixed cluster's small device no room: make demo's
        # re-plan found no plan with a 205 MiB reserve on its 32 MiB device)
        reserve = cm.reserve_extra_bytes + excess
    refitted = rebuilt(cm, profiles, host, reserve)
    # What no rank's own time explains: the refitted ranks match their measured work, so the
    # rest of the measured step is the model's blind spot: collectives it takes as hidden
    # under compute that are not (no spare cores, or a backend that blocks), per-step
    # collectives it does not cost (token count, gradient norm), and ranks that meet at every
    # unit's collectives (a near-balanced plan's sum of per-unit maxima exceeds the maximum
    # of per-rank sums). Refitted afresh each time (not compounded), never negative.
    sync = max(0.0, log.job_step_s() - refitted.evaluate(plan).step_s)
    return Calibration(refitted, fits, compute, optimizer, host_scale, reserve, sync)
