"""The order in which a stage runs its micro-batches' forwards and backwards (`stage_ops`).

GPipe: every forward, then every backward (a stage holds all M micro-batches' boundaries).
1F1B: stage s of S runs min(M, S - s - 1) warm-up forwards, then one forward and one backward
in turn, then the remaining backwards (the cool-down): it holds at most S - s micro-batches'
boundaries at once, what `costmodel.stages.in_flight` charges. Backwards run in micro-batch
order in both, so two neighbouring stages exchange their boundaries in the same order and a
stage's blocking receive always has its sender's matching send ahead of it (no deadlock: the
sends are asynchronous). The last stage's forward of a micro-batch ends in the head's loss and
backward (runtime/engine/head_pass.py), as the flat engine's head pass does."""

from __future__ import annotations

from cephalo.errors import CephaloError
from cephalo.planner.plan import SCHEDULES

FORWARD, BACKWARD = "F", "B"


def stage_ops(schedule: str, stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """Stage `stage`'s operations of one step, in order: (FORWARD | BACKWARD, micro-batch)."""
    if schedule not in SCHEDULES:
        raise CephaloError(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if not 0 <= stage < stages:
        raise CephaloError(f"stage {stage} is not one of the pipeline's {stages} stages")
    M = micro_batches
    if stages > M:
        raise CephaloError(
            f"{M} micro-batches cannot fill a pipeline of {stages} stages: give "
            f"num_micro_batches >= {stages}"
        )
    if schedule == "gpipe":
        return [(FORWARD, j) for j in range(M)] + [(BACKWARD, j) for j in range(M)]
    warm = min(M, stages - stage - 1)
    ops = [(FORWARD, j) for j in range(warm)]
    for j in range(M - warm):
        ops += [(FORWARD, warm + j), (BACKWARD, j)]
    ops += [(BACKWARD, j) for j in range(M - warm, M)]
    return ops


def peak_in_flight(ops: list[tuple[str, int]]) -> int:
    """The most micro-batches a stage holds at once under `ops` (forward run, backward not)."""
    held = peak = 0
    for kind, _ in ops:
        held += 1 if kind == FORWARD else -1
        peak = max(peak, held)
    return peak
