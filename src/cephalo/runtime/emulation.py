"""Device emulation on CPU: a CPU rank stands in for a slower device.

A slowdown factor f stretches compute: after each piece of unit compute (and of the
optimizer step) that took t seconds, the rank sleeps (f - 1) x t, so it looks f times
slower to the rest of the job (collectives and waits are not stretched: links are emulated
by the real transport). The profiler times the same pieces under the same emulator. The
memory side of emulation is the ledger's budget (`MemoryLedger(budget_bytes=...)`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from cephalo.errors import CephaloError


@dataclass
class ComputeEmulator:
    """Stretches measured compute time by `slowdown`."""

    slowdown: float = 1.0
    """1.0 = run at native speed; 3.0 = look three times slower."""
    stretched_s: float = 0.0
    """Total sleep added so far."""

    def __post_init__(self) -> None:
        if not self.slowdown >= 1.0:
            raise CephaloError(
                f"slowdown must be >= 1 (a CPU rank can only emulate a slower device), got {self.slowdown}"
            )

    def stretch(self, measured_s: float) -> float:
        """Sleep so that a compute piece of `measured_s` lasts `slowdown` times as long;
        returns the emulated duration."""
        extra = (self.slowdown - 1.0) * measured_s
        if extra > 0:
            time.sleep(extra)
            self.stretched_s += extra
        return measured_s + extra
