"""What `cephalo advise` answers: the frontier's clusters, how exact the search was, what each
device of a cluster is worth, and the whole answer with its JSON contract (`Advice.to_json`).
The search that produces them is `advise/advisor.py`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from cephalo.specs.offers import Offer


# ====================================================================== results
@dataclass
class FrontierPoint:
    """One cluster with its price and the planner's throughput (the JSON `E`)."""

    counts: dict[str, int]
    """GPUs per offer name (offers not used are left out)."""
    cluster: str
    """The spec string `cephalo plan --cluster` accepts and plans to this throughput."""
    description: str
    price_per_hour: float
    samples_per_s: float
    tokens_per_s: float

    @property
    def gpus(self) -> int:
        return sum(self.counts.values())

    @property
    def usd_per_million_tokens(self) -> float:
        return usd_per_million_tokens(self.price_per_hour, self.tokens_per_s)

    def to_json(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "price_per_hour": self.price_per_hour,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "usd_per_million_tokens": self.usd_per_million_tokens,
            "gpus": self.gpus,
            "counts": dict(self.counts),
            "description": self.description,
        }


def usd_per_million_tokens(price_per_hour: float, tokens_per_s: float) -> float:
    return price_per_hour / (tokens_per_s * 3600.0) * 1e6 if tokens_per_s > 0 else math.inf


@dataclass
class SearchBound:
    """What the search may have missed."""

    tolerance: float
    """Every cluster the search skipped has at most (1 + tolerance) x the frontier's
    throughput at its price (0: the frontier is exact)."""
    exact_below_price: float | None
    """The frontier is exact for prices below this (None: everywhere)."""
    levels: list[tuple[float, float]] = field(default_factory=list)
    """(price from which, tolerance) each time the tolerance rose."""

    @property
    def exact(self) -> bool:
        return self.tolerance == 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "exact": self.exact,
            "tolerance": self.tolerance,
            "exact_below_price_per_hour": self.exact_below_price,
            "levels": [{"from_price_per_hour": p, "tolerance": g} for p, g in self.levels],
        }

    def describe(self) -> str:
        if self.exact:
            return "exact: the frontier equals planning every cluster the offers allow"
        return (
            f"exact below ${self.exact_below_price:,.2f}/h; above, a cluster the search skipped has "
            f"at most {100 * self.tolerance:.2g}% more throughput than the frontier at its price"
        )


@dataclass
class SearchStats:
    clusters: int
    """Count vectors the offers allow (the empty one excluded)."""
    plans: int
    """Clusters planned (the tolerance rises after `plans_per_level` of them; an answer the
    advisor had cached from an earlier search counts too, so the result does not depend on it)."""
    skipped: int
    """Complete clusters met and skipped on their bound."""
    expanded: int
    """Partial count vectors expanded."""
    pruned: int
    """Partial count vectors dropped on their bound (each stands for all its completions)."""
    requeued: int
    """Partial count vectors put back in line because their bound rose."""
    wall_s: float
    planner_s: float

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Search:
    frontier: list[FrontierPoint]
    bound: SearchBound
    stats: SearchStats


@dataclass
class DeviceValue:
    """One group of identical devices of a cluster: what one of them is worth."""

    type: str
    offer: str | None
    count: int
    """Devices in the group."""
    price_per_hour: float | None
    """One device's price (None: not among the offers)."""
    cluster_without: str
    samples_per_s_without: float
    """The planner's throughput without one device of the group (0: nothing fits)."""
    tokens_per_s_lost: float
    share_lost: float
    pays_for_itself: bool | None
    """The cluster's price per token is lower with the device than without (None: no price)."""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Addition:
    """One more unit of an offer added to a cluster."""

    offer: str
    type: str
    gpus: int
    price_per_hour: float
    cluster_with: str
    samples_per_s_with: float
    tokens_per_s_gained: float
    tokens_per_s_per_usd: float
    """Throughput gained per USD per hour spent on it."""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Marginal:
    """Marginal values of the devices of one cluster (`base`: chosen | have)."""

    base: str
    cluster: str
    description: str
    label: str
    """Short name: GPUs per offer for a cluster of the offers, else the description."""
    price_per_hour: float | None
    samples_per_s: float
    tokens_per_s: float
    devices: list[DeviceValue]
    additions: list[Addition]

    @property
    def best_to_add(self) -> Addition | None:
        gains = [a for a in self.additions if a.tokens_per_s_gained > 0]
        return max(gains, key=lambda a: a.tokens_per_s_per_usd, default=None)

    def to_json(self) -> dict[str, Any]:
        best = self.best_to_add
        return {
            "base": self.base,
            "cluster": self.cluster,
            "description": self.description,
            "label": self.label,
            "price_per_hour": self.price_per_hour,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "devices": [d.to_json() for d in self.devices],
            "additions": [a.to_json() for a in self.additions],
            "best_to_add": best.to_json() if best else None,
        }


# ====================================================================== helpers
def select_frontier(records: list[tuple[int, float, tuple]]) -> list[tuple[int, float, tuple]]:
    """The Pareto frontier of (price, samples/s, key) records: per price the most
    samples/s (ties: the smaller key, i.e. fewer GPUs, then the smaller count vector), kept
    if it beats every cheaper one."""
    best_at: dict[int, tuple[int, float, tuple]] = {}
    for r in records:
        cur = best_at.get(r[0])
        if cur is None or (r[1], fewer_first(r[2])) > (cur[1], fewer_first(cur[2])):
            best_at[r[0]] = r
    out, best = [], 0.0
    for price in sorted(best_at):
        r = best_at[price]
        if r[1] > best:
            out.append(r)
            best = r[1]
    return out


def fewer_first(key: tuple) -> tuple:
    """A key that sorts the other way (smaller keys win ties)."""
    n, units = key
    return (-n, tuple(-u for u in units))


def best_under_budget(frontier: list[FrontierPoint], budget: float) -> FrontierPoint | None:
    """The most throughput at no more than `budget` USD per hour."""
    within = [p for p in frontier if p.price_per_hour <= budget + 1e-9]
    return within[-1] if within else None


def cheapest_meeting_target(
    frontier: list[FrontierPoint], tokens_per_s: float
) -> FrontierPoint | None:
    """The cheapest cluster with at least `tokens_per_s`."""
    return next((p for p in frontier if p.tokens_per_s >= tokens_per_s), None)


# ====================================================================== one answer
@dataclass
class Advice:
    """What `cephalo advise` prints and writes (`to_json` is its JSON contract)."""

    model: str
    global_batch: int
    seq_len: int
    dtype: str
    offers: list[Offer]
    left_out: list[str]
    search: Search
    budget: float | None
    target_tokens_per_s: float | None
    best_under_budget: FrontierPoint | None
    cheapest_meeting_target: FrontierPoint | None
    chosen: FrontierPoint | None
    chosen_why: str
    marginal: list[Marginal]
    problems: list[str]
    """What the budget or the target could not have, one message each (the command exits
    with them after printing and writing the rest)."""

    @property
    def frontier(self) -> list[FrontierPoint]:
        return self.search.frontier

    def to_json(self) -> dict[str, Any]:
        def e(p: FrontierPoint | None) -> dict | None:
            return p.to_json() if p is not None else None

        return {
            "frontier": [p.to_json() for p in self.frontier],
            "best_under_budget": e(self.best_under_budget),
            "cheapest_meeting_target": e(self.cheapest_meeting_target),
            "marginal": [m.to_json() for m in self.marginal],
            "chosen": e(self.chosen),
            "chosen_why": self.chosen_why,
            "bound": self.search.bound.to_json(),
            "search": self.search.stats.to_json(),
            "settings": {
                "model": self.model,
                "global_batch": self.global_batch,
                "seq_len": self.seq_len,
                "dtype": self.dtype,
                "budget_per_hour": self.budget,
                "target_tokens_per_s": self.target_tokens_per_s,
            },
            "offers": [o.to_dict() for o in self.offers],
            "left_out": list(self.left_out),
            "problems": list(self.problems),
        }
