"""An emulated device whose speed changes during a run (thermal throttling, a neighbour's
job): `STEP:RANK:SLOWDOWN[,...]`, rank RANK computes at SLOWDOWN from step STEP (1-based) on,
whatever its profile says.

Plain values, no torch: the job config checks the text (`parallel.emulate_drift`), the demo
reads when its change comes, and `runtime.emulation.drifted_slowdown` applies it to a rank."""

from __future__ import annotations

from dataclasses import dataclass

from cephalo.errors import CephaloError


@dataclass(frozen=True)
class DriftEntry:
    """From step `step` on, rank `rank` computes at `slowdown`."""

    step: int
    rank: int
    slowdown: float


def parse_drift(spec: str | None, what: str = "parallel.emulate_drift") -> list[DriftEntry]:
    """The entries of `spec` (None or empty: none); `what` names the setting in errors."""
    out = []
    for item in filter(None, (spec or "").replace(" ", "").split(",")):
        try:
            at, who, factor = item.split(":")
            entry = DriftEntry(int(at), int(who), float(factor))
        except ValueError:
            raise CephaloError(
                f"{what}={item!r}: write STEP:RANK:SLOWDOWN[,...], e.g. 10:1:4"
            ) from None
        if entry.step < 1 or entry.rank < 0 or not entry.slowdown >= 1.0:
            # an emulator can only make a CPU rank slower than it is (runtime/emulation.py)
            raise CephaloError(
                f"{what}={item!r}: the step must be >= 1, the rank >= 0 and the slowdown >= 1"
            )
        out.append(entry)
    return out


def slowdown_at(entries: list[DriftEntry], step: int, rank: int) -> float | None:
    """The slowdown of the latest entry for `rank` at or before `step`; None: no drift yet."""
    found: DriftEntry | None = None
    for e in entries:
        if e.rank == rank and e.step <= step and (found is None or e.step >= found.step):
            found = e
    return None if found is None else found.slowdown
