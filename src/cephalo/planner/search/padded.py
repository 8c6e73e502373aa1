"""The planner's search where near-even splits run padded-even (collective_cost.py).

Why a search of its own. The padding's charge depends on the split as a whole: every rank's
collectives move N x u of each unit and its padded buffers hold u, for u the largest state
fraction, and only while N x u <= PAD_EVEN_SLACK. The planner's search (optimiser.py,
batch_split.py) treats the ranks apart given a step time T, so it cannot weigh a charge set by
the fractions it is about to choose; and the charge is not monotone in the split: a split just
past the threshold pays nothing, one just inside pays its padding. So the planner first solves the charge-free
problem (every cost at most the true one: a lower bound on every plan, the search
unchanged); where its optimum does not run padded, or its padding costs it nothing, that plan
is the optimum. Otherwise the optimum is the better of two exact sub-problems:

- unpadded: some rank owns at least `least_unpadded_fraction` (the split runs unpadded, the
  charge-free costs are its true costs): for each kind of rank, the charge-free search with
  that floor on one rank of the kind (ranks of a kind are interchangeable);
- padded, max fraction u in [1/N, PAD_EVEN_SLACK / N]: the search charged at u with every
  fraction capped at u, W(u), is exact for the plans whose largest fraction is u (a plan with
  a smaller largest fraction is charged too much, never too little), so the padded optimum is
  min over u of W(u). W is not monotone nor convex in u (the charge grows with u, the cap
  loosens, and the discrete choices change), so a branch and bound over u finds it: on
  [a, b] no padded plan beats the search charged at a and capped at b (charged at most its
  true padding, allowed at least its fractions), whose bisection's infeasible end is a
  certified lower bound; intervals whose bound is not below the best plan found are dropped.

Every candidate is a plan, judged by `CostModel.evaluate` (its true charge), so the planner
returns the best of them by the same formula that evaluates it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from cephalo.costmodel.collectives import PAD_EVEN_SLACK, least_unpadded_fraction
from cephalo.log import logger

C = TypeVar("C")

PADDED_REL_TOL = 1e-7
"""Relative precision of the searches the branch and bound runs (tighter than the plain
search's, so that their lower bounds stay below the optimum by less than the bound's tolerance)."""
PRUNE_REL_TOL = 4e-6
"""An interval whose lower bound is within this (relative) of the best plan is dropped."""
MAX_PADDED_SEARCHES = 80
"""At most this many searches in the branch and bound (each a full search at one charge)."""
MIN_INTERVAL = 1e-9
"""Intervals of largest fraction narrower than this (relative to 1 / N) are not split further."""
EVEN_END_SPLIT = 1 / 16
"""Where an interval that starts at the exactly even split is cut (a share of its width from
that end). The even split pays nothing, so it is often the optimum, and the bounds of the
intervals next to it approach it only as they narrow: cutting near it proves it in a third
of the searches halving would take (the search stays complete either way)."""
CLIP_SLACK = 1e-12
"""A cap u on the fractions is passed on as u (1 + this): N fractions of exactly 1 / N can sum
to a hair below 1 in floating point, which made the exactly even split look infeasible."""


@dataclass
class Attempt(Generic[C]):
    """One search's answer: its choice, a step time no plan of that search reaches, and the
    choice's true step time (`CostModel.evaluate`; inf if it does not fit)."""

    choice: C
    lower: float
    step_s: float
    pad: float = 0.0
    """The choice's split's padding (`CostModel.split_padding`)."""


def best_with_padding(
    world: int,
    relaxed: Attempt[C],
    relaxed_pad: float,
    relaxed_free_s: float,
    kinds: list[int],
    search: Callable[..., Attempt[C] | None],
) -> C:
    """The best plan where near-even splits pay their padding (see the module docstring).

    `relaxed`: the charge-free optimum, `relaxed_pad` its split's padding (0: it runs
    unpadded), `relaxed_free_s` its step time without the charge. `kinds`: one rank of each kind. `search(pad=, clip=, floor_rank=, floor=)` runs
    the planner's search under that charge (None where nothing fits)."""
    if relaxed_pad <= 0 or relaxed.step_s <= relaxed_free_s * (1.0 + 1e-12):
        # it runs unpadded, or its padding costs it nothing: the relaxation's optimum is met
        return relaxed.choice
    best = relaxed
    searches = 0

    def consider(a: Attempt[C] | None, charged: float | None = None) -> None:
        """Keep `a` if it is the best so far; made under a charge of `charged`, only if it runs
        padded to at most that: the search's tables then hold its memory with the planner's
        slack, as every plan the planner returns does."""
        nonlocal best, searches
        searches += 1
        if a is None or (charged is not None and not 0.0 < a.pad <= charged * (1 + 1e-9)):
            return
        if a.step_s < best.step_s:
            best = a

    floor = least_unpadded_fraction(world)
    if floor < 1.0:
        for j in kinds:
            consider(search(floor_rank=j, floor=floor))

    lo, hi = 1.0 / world, PAD_EVEN_SLACK / world
    # the exactly even split as a plan of its own: it pays no padding, and the branch and
    # bound would only approach it
    consider(search(pad=lo, clip=lo * (1 + CLIP_SLACK)), lo)

    def bound(a: float, b: float) -> float:
        att = search(pad=a, clip=b * (1 + CLIP_SLACK))
        consider(att, a)
        return att.lower if att is not None else math.inf

    # the whole range needs no search for its bound: the charge-free optimum's is one
    heap = [(relaxed.lower, lo, hi)]
    while heap:
        lower, a, b = heapq.heappop(heap)
        if lower >= best.step_s * (1.0 - PRUNE_REL_TOL) or math.isinf(lower):
            break  # the smallest bound left: no padded plan beats the best found
        if b - a <= MIN_INTERVAL / world:
            continue
        if searches >= MAX_PADDED_SEARCHES:
            logger.debug(
                "padded-even search stopped after %d searches: within %.2g of the optimum",
                searches,
                1.0 - lower / best.step_s,
            )
            break
        mid = a + (b - a) * (EVEN_END_SPLIT if a == lo else 0.5)
        # W(mid): a plan charged as it runs
        consider(search(pad=mid, clip=mid * (1 + CLIP_SLACK)), mid)
        for x, y in ((a, mid), (mid, b)):
            heapq.heappush(heap, (max(lower, bound(x, y)), x, y))
    return best.choice
