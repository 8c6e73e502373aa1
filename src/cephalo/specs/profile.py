"""What the cost model knows about one device type: measured curves, as plain values.

A `DeviceProfile` comes either from the catalog (published measurements of real GPUs) or
from `cephalo profile` (measured on the devices at hand). The cost model reads nothing else
about a device, so a plan for a cluster you do not own and a plan from measurements go
through the same formulas.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

from cephalo.errors import CephaloError


@dataclass
class Curve:
    """A monotone non-decreasing function of micro-batch size, from measured points.

    Piecewise-linear inside the measured range, linear beyond it (slope of a least-squares
    line through the upper half of the points, never negative), and forced monotone by a
    running maximum so that noise in the measurements (1-2%) cannot make a larger
    micro-batch look cheaper.
    """

    xs: list[float]
    ys: list[float]

    def __post_init__(self) -> None:
        if len(self.xs) != len(self.ys) or not self.xs:
            raise ValueError("Curve needs equally many xs and ys, at least one")
        pts = sorted(zip(self.xs, self.ys, strict=True))
        self.xs = [float(x) for x, _ in pts]
        running, ys = float("-inf"), []
        for _, y in pts:
            running = max(running, float(y))
            ys.append(running)
        self.ys = ys

    def _edge_slope(self, upper: bool) -> float:
        """Slope used beyond the measured range: least squares over the upper (or lower) half."""
        n = len(self.xs)
        if n == 1:
            return self.ys[0] / self.xs[0] if self.xs[0] > 0 else 0.0
        half = max(2, (n + 1) // 2)
        xs, ys = (self.xs[-half:], self.ys[-half:]) if upper else (self.xs[:2], self.ys[:2])
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = (
            sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var > 0 else 0.0
        )
        return max(slope, 0.0)

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x >= xs[-1]:
            return ys[-1] + self._edge_slope(upper=True) * (x - xs[-1])
        if x <= xs[0]:
            return max(ys[0] - self._edge_slope(upper=False) * (xs[0] - x), 0.0)
        i = bisect.bisect_right(xs, x)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    @classmethod
    def linear(cls, slope: float, intercept: float, upto: int = 16) -> Curve:
        """A curve from a fitted line (y = slope * x + intercept), sampled at 1..upto."""
        return cls(
            [float(x) for x in range(1, upto + 1)],
            [max(slope * x + intercept, 0.0) for x in range(1, upto + 1)],
        )

    def to_dict(self) -> dict:
        return {"xs": self.xs, "ys": self.ys}

    @classmethod
    def from_dict(cls, d: dict) -> Curve:
        return cls(list(d["xs"]), list(d["ys"]))


@dataclass
class UnitProfile:
    """One unit kind (embedding / block / head) on one device type."""

    fwd_s: Curve
    """Forward time (seconds) of the unit vs micro-batch size."""
    bwd_s: Curve
    """Backward time (seconds, without the recompute) vs micro-batch size."""
    activation_bytes: Curve
    """Peak extra device memory while recomputing + backpropagating the unit at micro-batch m
    (its autograd graph and temporaries), bytes, vs micro-batch size."""

    def to_dict(self) -> dict:
        return {k: getattr(self, k).to_dict() for k in ("fwd_s", "bwd_s", "activation_bytes")}

    @classmethod
    def from_dict(cls, d: dict) -> UnitProfile:
        return cls(**{k: Curve.from_dict(d[k]) for k in ("fwd_s", "bwd_s", "activation_bytes")})


@dataclass
class DeviceProfile:
    """Everything the cost model needs about one device type for one (model, seq_len, dtype)."""

    device_type: str
    memory_bytes: int
    """Usable device memory (capacity, or the emulated budget)."""
    units: dict[str, UnitProfile]
    """Keyed by unit kind: `embedding`, `block`, `head`."""
    optimizer_s_per_param: float
    """AdamW step time per owned parameter (fp32 master + moments), seconds."""
    host_copy_bytes_per_s: float
    """Device <-> host copy bandwidth for offloaded boundary activations."""
    source: str = "catalog"
    """`catalog` (published data) or `measured` (cephalo profile)."""
    meta: dict = field(default_factory=dict)
    async_copies: bool = True
    """Host copies run beside the compute (a GPU's copy engine on a side stream), so the cost
    model overlaps them with it. False on a CPU: the copies are memcpys on the compute
    thread and add to the compute time."""
    boundary_writes_in_compute: bool = True
    """Without async copies: a boundary written to the host costs what the profiled store
    into device memory costs (a memcpy inside the unit compute). False on an emulated device
    with a link bandwidth (`pcie=`): each write is then a copy of its own at that bandwidth."""
    host_optimizer_s_per_param: float | None = None
    """Host AdamW time per host-held parameter of one rank on the host this device was measured
    on (all ranks of that host measuring at once when they share it); None (the catalog): the
    cluster's or the catalog's default for the host."""

    def to_dict(self) -> dict:
        return {
            "device_type": self.device_type,
            "memory_bytes": self.memory_bytes,
            "units": {k: u.to_dict() for k, u in self.units.items()},
            "optimizer_s_per_param": self.optimizer_s_per_param,
            "host_copy_bytes_per_s": self.host_copy_bytes_per_s,
            "source": self.source,
            "meta": self.meta,
            "async_copies": self.async_copies,
            "host_optimizer_s_per_param": self.host_optimizer_s_per_param,
            "boundary_writes_in_compute": self.boundary_writes_in_compute,
        }

    @classmethod
    def from_dict(cls, d: dict) -> DeviceProfile:
        return cls(
            device_type=d["device_type"],
            memory_bytes=int(d["memory_bytes"]),
            units={k: UnitProfile.from_dict(u) for k, u in d["units"].items()},
            optimizer_s_per_param=float(d["optimizer_s_per_param"]),
            host_copy_bytes_per_s=float(d["host_copy_bytes_per_s"]),
            source=d.get("source", "catalog"),
            meta=d.get("meta", {}),
            # profiles written before the field: measured on a CPU host means no async copies
            async_copies=bool(
                d.get("async_copies", not str(d.get("meta", {}).get("host", "")).startswith("cpu:"))
            ),
            boundary_writes_in_compute=bool(d.get("boundary_writes_in_compute", True)),
            host_optimizer_s_per_param=(
                None
                if d.get("host_optimizer_s_per_param") is None
                else float(d["host_optimizer_s_per_param"])
            ),
        )


@dataclass
class CommProfile:
    """Collective performance between the ranks (measured, or defaults from the cluster spec)."""

    bytes_per_s: float
    """Effective bandwidth of all_gather_v / reduce_scatter_v over the slowest link."""
    latency_s: float = 0.0
    """Fixed cost per collective call."""


@dataclass
class MeasuredProfiles:
    """What `profile_devices` returns, and what `cephalo profile --out` writes."""

    profiles: dict[str, DeviceProfile]
    """By device type key."""
    comm: CommProfile | None
    """Measured collectives; None in a single process (no links to measure)."""
    model: str
    seq_len: int
    dtype: str
    measured: list[str] = field(default_factory=list)
    """What was measured this time (type keys, and `comm`)."""
    cached: list[str] = field(default_factory=list)
    """What came from the database."""
    elapsed_s: float = 0.0

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "seq_len": self.seq_len,
            "dtype": self.dtype,
            "profiles": {k: p.to_dict() for k, p in self.profiles.items()},
            "comm": None
            if self.comm is None
            else {"bytes_per_s": self.comm.bytes_per_s, "latency_s": self.comm.latency_s},
            "measured": self.measured,
            "cached": self.cached,
            "elapsed_s": self.elapsed_s,
        }

    @classmethod
    def from_dict(cls, d: dict) -> MeasuredProfiles:
        return cls(
            profiles={k: DeviceProfile.from_dict(p) for k, p in d["profiles"].items()},
            comm=CommProfile(**d["comm"]) if d.get("comm") else None,
            model=d["model"],
            seq_len=int(d["seq_len"]),
            dtype=d["dtype"],
            measured=list(d.get("measured", [])),
            cached=list(d.get("cached", [])),
            elapsed_s=float(d.get("elapsed_s", 0.0)),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> MeasuredProfiles:
        p = Path(path)
        try:
            d = json.loads(p.read_text())
            return cls.from_dict(d)
        except OSError as e:
            raise CephaloError(f"cannot read profile file {p}: {e.strerror or e}") from None
        except (ValueError, KeyError, TypeError) as e:
            raise CephaloError(
                f"{p} is not a profile file written by `cephalo profile --out` ({type(e).__name__}: {e})"
            ) from None
