"""A device profile's curves tabulated at integer micro-batch sizes, for the cost model's
broadcasting formulas (`CostModel._tables`): a table lookup per (batch, micro-batch) instead of
a curve evaluation."""

from __future__ import annotations

import math

import numpy as np

from cephalo.specs.profile import DeviceProfile


class CurveTable:
    """A profile curve tabulated at integer micro-batch sizes 0..n (value 0 at 0), grown on demand."""

    def __init__(self, curve, zero_at_zero: bool = True, rows: int = 1):
        self.curve = curve
        self.rows = rows
        """Profiled sequences per planned sample: `at(m)` reads the curve at m x rows (a DPO
        pair is two sequences: `AdapterSpec.rows_per_sample`)."""
        self.values = np.zeros(1)
        self.zero_at_zero = zero_at_zero

    def at(self, x: np.ndarray | int) -> np.ndarray:
        x = np.asarray(x, dtype=np.int64) * self.rows
        need = int(x.max()) if x.size else 0
        if need >= len(self.values):
            n = max(need + 1, 2 * len(self.values))
            start = len(self.values)
            # the curve is linear beyond its last measured point: evaluate it up to one step past
            # that point and extend the line (calling it per point would refit the slope each time)
            last = int(math.ceil(self.curve.xs[-1])) + 1
            direct = np.array([self.curve(float(v)) for v in range(start, min(n, last + 1))])
            values = np.concatenate([self.values, direct])
            if n > len(values):
                slope = self.curve(float(last)) - self.curve(float(last - 1))
                beyond = np.arange(len(values), n)
                values = np.concatenate([values, self.curve(float(last)) + slope * (beyond - last)])
            self.values = values
        return self.values[x]


class TypeTables:
    """Tabulated curves of one device profile (one table per unit kind and quantity)."""

    def __init__(self, profile: DeviceProfile, rows: int = 1):
        self.profile = profile
        units = profile.units.items()
        self.fwd = {k: CurveTable(u.fwd_s, rows=rows) for k, u in units}
        self.bwd = {k: CurveTable(u.bwd_s, rows=rows) for k, u in units}
        self.act = {k: CurveTable(u.activation_bytes, rows=rows) for k, u in units}
