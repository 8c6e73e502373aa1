"""The planner's optimiser: bisection over the step time, and the search under the padding charge.

`optimise` bisects T over the feasibility of batch_split.py, growing the groups' tables where
the optimum might need larger batches, then water-fills the fractions (water_fill.py).
`optimise_charged` runs it where the backend pads near-even splits: the charge-free optimum, or
a better plan that pays its padding (padded_search.py runs the sub-searches). `unless_marginal`
keeps a plan with host state or waiting reduce-scatters only where it is clearly faster.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from cephalo.costmodel.model import CostModel
from cephalo.errors import PlanDoesNotFit
from cephalo.planner.choice import Choice, choice_to_plan
from cephalo.planner.does_not_fit import does_not_fit
from cephalo.planner.search.batch_split import feasible_split, fits_at_all, use_exact_split
from cephalo.planner.search.padded import PADDED_REL_TOL, Attempt, best_with_padding
from cephalo.planner.search.rank_tables import SearchRegime, TableCache, rank_groups, tabulate
from cephalo.planner.search.water_fill import step_time_of, water_fill


def optimise(
    cm: CostModel,
    B: int,
    allowed: SearchRegime,
    explain: bool = True,
    cache: TableCache | None = None,
) -> Choice:
    """The optimum under `allowed` (its padding charge included), `lower` set to a step time at
    which no plan is feasible (a certified lower bound). `cache`: the tables earlier searches of
    the same plan made (None: tabulate afresh)."""
    groups = rank_groups(cm, allowed)
    found = fits_at_all(cm, groups, B, allowed, cache)
    if found is None:
        if not explain:
            raise PlanDoesNotFit(f"{cm.model.name} does not fit at global batch {B}")
        raise does_not_fit(cm, B, allowed)
    while True:
        exact = use_exact_split(groups, B)
        T_hi = step_time_of(cm, groups, found, allowed)
        T_lo = 0.0
        while T_hi - T_lo > allowed.rel_tol * T_hi:
            mid = 0.5 * (T_lo + T_hi)
            f = feasible_split(groups, mid, B, exact, cm, allowed)
            if f is None:
                T_lo = mid
            else:
                T_hi, found = mid, f
        # a group whose largest tabulated batch still runs within T might do better with more;
        # otherwise no rank can take more than bmax samples at this T and the search was complete
        grow = [g for g in groups if g.bmax < B and float(np.min(g.time[g.bmax])) <= T_hi]
        if not grow:
            break
        for g in grow:
            tabulate(cm, g, min(B, 2 * g.bmax), allowed, cache)
        found = feasible_split(
            groups, T_hi, B, use_exact_split(groups, B), cm, allowed
        ) or fits_at_all(cm, groups, B, allowed, cache)
    choice = water_fill(cm, groups, found, allowed)
    choice.lower = T_lo
    return choice


def optimise_charged(
    cm: CostModel,
    B: int,
    allowed: SearchRegime,
    explain: bool = True,
    cache: TableCache | None = None,
) -> Choice:
    """`optimise` where the backend pads near-even splits (`CostModel.padded_collectives`):
    the charge-free optimum, or a better plan that pays its padding (padded_search.py). Its
    sub-searches share `cache` (None: one of their own): they repeat most tables."""
    cache = cache if cache is not None else TableCache(cm)
    relaxed = optimise(cm, B, allowed, explain, cache)
    if not cm.padded_collectives or len(cm.devices) < 2:
        return relaxed

    def step_s(c: Choice, padded: bool = True) -> float:
        plan = choice_to_plan(cm, B, "cephalo", c, None, predict=False)
        ev = cm.evaluate(plan, charge_padding=padded)
        return ev.step_s if ev.fits else math.inf

    def search(**regime) -> Attempt[Choice] | None:
        try:
            regime_now = replace(allowed, rel_tol=PADDED_REL_TOL, **regime)
            c = optimise(cm, B, regime_now, False, cache)
        except PlanDoesNotFit:
            return None
        return Attempt(c, c.lower, step_s(c), cm.split_padding(c.fraction))

    kinds = [g.ranks[0] for g in rank_groups(cm)]
    return best_with_padding(
        len(cm.devices),
        Attempt(relaxed, relaxed.lower, step_s(relaxed), cm.split_padding(relaxed.fraction)),
        cm.split_padding(relaxed.fraction),
        step_s(relaxed, padded=False),
        kinds,
        search,
    )


def unless_marginal(
    cm: CostModel,
    B: int,
    allowed: SearchRegime,
    choice: Choice,
    option: str,
    min_gain: float,
    cache: TableCache | None = None,
) -> tuple[Choice, SearchRegime]:
    """`choice`, or the best plan without `option` (`host`: host state; `serial`: ranks
    waiting for each reduce-scatter) where that is (almost) as fast; with what the kept plan
    allows. Both options trade time for memory, and a gain below `min_gain` is within the
    cost model's error (measured on the emulated clusters: a plan waiting on its reduce-scatters
    for a 0.03 % predicted gain ran 10 % slower, bench/results/hetero_throughput.md B). `cache`:
    the tables of the plan's searches so far."""
    narrower = replace(allowed, **{option: False})
    try:
        # the reason it does not fit is not shown
        without = optimise_charged(cm, B, narrower, False, cache)
    except PlanDoesNotFit:
        return choice, allowed
    steps = [
        cm.evaluate(choice_to_plan(cm, B, "cephalo", c, None)).step_s for c in (choice, without)
    ]
    if steps[0] < (1.0 - min_gain) * steps[1]:
        return choice, allowed
    return without, narrower
