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
  fragmentation).

Link bandwidths are not refitted: the time a rank waits in a collective mixes the link with
the other ranks' lateness (load imbalance), which the compute scale already explains.

All ranks hold the same gathered measurements, so every rank computes the same refit.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field, replace

from cephalo.planning.costmodel import CostModel, HostResources
from cephalo.planning.plan import Plan
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


@dataclass
class StepLog:
    """Per-step measurements of every rank since the plan now running started."""

    steps: list[list[RankSample]] = field(default_factory=list)
    window: int = 0
    """Calibrate from the last `window` steps only (0: every step since the plan started), so
    that a device that changed speed is seen as it is now."""

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
        self.steps.clear()

    def usable(self) -> list[list[RankSample]]:
        """The steps calibration reads: all but the first (warm-up) one, the last `window`."""
        usable = self.steps[1:]
        return usable[-self.window :] if self.window else usable

    def median(self, rank: int, attr: str) -> float:
        return statistics.median(getattr(s[rank], attr) for s in self.usable())

    def max_peak(self, rank: int) -> int:
        return max(s[rank].peak_bytes for s in self.usable())


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

    def line(self) -> str:
        return (
            f"rank {self.rank} ({self.device}): step {self.predicted_step_s:.3f} s predicted / "
            f"{self.measured_step_s:.3f} s measured, compute {self.predicted_compute_s:.3f} / "
            f"{self.measured_compute_s:.3f} s, peak {self.predicted_peak_bytes / 2**20:.1f} / "
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
    """The memory reserve the new model holds back (None: unchanged, a fraction of capacity)."""

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
            out.append(f"memory reserve {self.reserve_bytes / 2**20:.1f} MiB")
        return out

    def to_dict(self) -> dict:
        return {
            "compute_scale": self.compute_scale,
            "optimizer_scale": self.optimizer_scale,
            "host_optimizer_scale": {str(k): v for k, v in self.host_optimizer_scale.items()},
            "reserve_bytes": self.reserve_bytes,
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
    reserve_bytes: int | None = None,
) -> CostModel:
    """`cm` with other profiles, hosts or reserve (everything else as it was)."""
    return CostModel(
        cm.model,
        cm.seq_len,
        cm.dtype,
        cm.devices,
        profiles if profiles is not None else cm.profiles,
        cm.comm,
        reserve_bytes=reserve_bytes if reserve_bytes is not None else cm.reserve_bytes,
        reserve_fraction=cm.reserve_fraction,
        meta=cm.meta,
        host=host if host is not None else cm.host,
        serial_reduce=cm.serial_reduce,
        adapter=cm.adapter,
        links=cm.links,
        cross_reduce=cm.cross_reduce,
        padded_collectives=cm.padded_collectives,
    )


def refit(cm: CostModel, plan: Plan, log: StepLog) -> Calibration:
    """The cost model refitted to `log`'s measurements of `plan` (see the module docstring).
    `log` must hold at least two steps (the first is not read)."""
    if len(log.usable()) < 1:
        raise ValueError("calibration needs at least two measured steps")
    predicted = cm.evaluate(plan).ranks
    n = len(predicted)
    fits, compute_by_type, opt_by_type = [], {}, {}
    host_scale: dict[int, float] = {}
    excess = 0
    for r, pc in enumerate(predicted):
        busy = log.median(r, "work_s")
        fits.append(
            RankFit(
                r,
                pc.device,
                pc.step_s,
                log.median(r, "step_s"),
                pc.compute_s,
                busy,
                pc.peak_bytes - pc.memory.reserve,
                log.max_peak(r),
            )
        )
        if plan.ranks[r].batch_size > 0 and (f := _ratio(busy, pc.compute_s)) is not None:
            compute_by_type.setdefault(pc.device, []).append(f)
        rp = plan.ranks[r]
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
    if excess > 0:  # some rank's measured peak is above its predicted peak with the reserve
        reserve = max(cm.reserve_for(cm.capacity_bytes(r)) for r in range(n)) + excess
    return Calibration(
        rebuilt(cm, profiles, host, reserve),
        fits,
        compute,
        optimizer,
        host_scale,
        reserve,
    )
