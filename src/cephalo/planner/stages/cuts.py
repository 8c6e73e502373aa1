"""The cut points of a pipeline: which contiguous range of units each stage runs.

Given S stages in order (their ranks, their micro-batch split, so their `StageTables` over every
range [first, last]), the links between them and M, the step (costmodel/stages.py `step_of`)

    sum_s t_s + 2 sum_l c_l + (M - 1) max(max_s t_s, max_l c_l) + max_s o_s

is a sum and two maxima over the stages, so no single-number DP is exact. The DP here walks the
stages in order over the next unit to cut at, keeping at each (stage, unit) every
Pareto-optimal label (max t, sum t, max o) of the stages so far: a label dominated in all three
can never give a shorter step, so the best label at the end is the exact optimum over every
cut (`tests/test_stages_planner.py` compares it with every cut on small instances).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cephalo.costmodel.stages import StageTables, step_of


@dataclass(frozen=True)
class Cuts:
    """The best cut: each stage's [first, last] and the predicted step."""

    step_s: float
    ranges: tuple[tuple[int, int], ...]


def _pareto(labels: list[tuple]) -> list[tuple]:
    """Labels (max t, sum t, max o, ranges) not dominated in the first three."""
    labels.sort(key=lambda x: (x[0], x[1], x[2]))
    kept: list[tuple] = []
    for lab in labels:
        if any(k[1] <= lab[1] and k[2] <= lab[2] for k in kept):
            continue  # an earlier label has a max t no larger and is no worse in both others
        kept.append(lab)
    return kept


def best_cuts(
    tables: list[StageTables],
    links: list[float],
    micro_batches: int,
    bound: float = math.inf,
    extra_s: float = 0.0,
) -> Cuts | None:
    """The exact best cut (module docstring), or None where no cut fits or none is shorter than
    `bound` (a step already found elsewhere: a label whose step so far reaches it is dropped,
    as the stages after it only add). `extra_s`: the same for every cut (the tied exchange)."""
    S = len(tables)
    U = tables[0].time.shape[0]
    if S > U:
        return None
    M = micro_batches
    # labels[a]: the stages so far cover units 0..a-1
    labels: dict[int, list[tuple]] = {0: [(0.0, 0.0, 0.0, ())]}
    for s, tab in enumerate(tables):
        nxt: dict[int, list[tuple]] = {}
        last_stage = s == S - 1
        ok = tab.fits & np.isfinite(tab.time)
        for a, labs in labels.items():
            ends = [U - 1] if last_stage else range(a, U - (S - 1 - s))
            for b in ends:
                if not ok[a, b]:
                    continue
                t, o = float(tab.time[a, b]), float(tab.overhead[a, b])
                bucket = nxt.setdefault(b + 1, [])
                for mt, st, mo, rngs in labs:
                    label = (max(mt, t), st + t, max(mo, o), (*rngs, (a, b)))
                    if step_of(*label[:3], links, M, extra_s) < bound:  # a floor
                        bucket.append(label)
        labels = {a: _pareto(v) for a, v in nxt.items() if v}
        if not labels:
            return None
    best: Cuts | None = None
    for mt, st, mo, rngs in labels.get(U, []):
        step = step_of(mt, st, mo, links, M, extra_s)
        if step < bound and (best is None or step < best.step_s):
            best = Cuts(step, rngs)
    return best if best is not None and math.isfinite(best.step_s) else None
