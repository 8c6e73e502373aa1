"""The split of a global batch over shard groups: exact, with few plans of each kind of group.

Groups of one *kind* (the same devices in the same order, hosts and links: `CostModel.group_key`)
share one `StepCurve`: T(b), the optimal step of such a group planned alone with b samples
(`planner.make_plan` on its `CostModel.group_model`), memoised. Identical groups are therefore
planned once per batch size whatever their number: the 128 nodes of a 1024-GPU cluster of six
node types are six curves. T is non-decreasing in b (more samples never make the best plan
faster). With c_k groups of kind k, the optimum of the grouping,

    min over splits (every group >= 1 sample, sum = B) of the slowest group's step,

is T* = the least value T_k(b) at which F(T*) = sum_k c_k maxB_k(T*) >= B, where maxB_k(t) is
the largest b with T_k(b) <= t (every group of a kind then takes maxB_k(T*) samples, and the
surplus is taken back from the groups with the most: fewer samples never lengthen a step).

The search evaluates few points of each curve:

1. a line per curve through T(1) and T(p), p the even share B / groups, predicts the t at which
   F(t) = B; each curve is *located* at t: maxB(t) and maxB(t) + 1 evaluated, by galloping
   from the line's guess and bisecting (two plans when the guess is right);
2. while F(t) is more than one sample per group away from B, a secant step on F gives a new t
   and the curves are located again (at most `REFINE_ROUNDS` times);
3. a walk over the curves' values to T*: up while F < B (the kinds with the least next value
   take one more sample per group), or down while F stays >= B without the largest value in use.

Step 3 makes the result exact whatever the lines predict (it only relies on T being
non-decreasing, as the bisection it replaces did); steps 1-2 keep the walk short, so a
grouping costs a few plans per kind of group. `tests/test_hierarchy_planner.py` compares the
result with every split on small instances and counts the plans on large ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from cephalo.costmodel.model import CostModel
from cephalo.errors import PlanDoesNotFit
from cephalo.planner.plan import Plan
from cephalo.planner.search.rank_tables import TableCache

REFINE_ROUNDS = 4
"""Secant steps on t (step 2) before the walk takes over."""


def _group_plan(
    cm: CostModel, b: int, planner_kw: dict, tables: TableCache | None = None
) -> Plan | None:
    """The best plan of one group at b samples, None where none fits. `tables`: those of the
    group's plans at other batch sizes (a pure function of what they are made for)."""
    from cephalo.planner.makers import make_plan

    try:
        return make_plan(cm, b, explain=False, tables=tables, **planner_kw)
    except PlanDoesNotFit:
        return None


def _renumbered(nodes: tuple[int, ...]) -> tuple[int, ...]:
    """Node ids numbered in order of first appearance (only which ranks share a node counts)."""
    index: dict[int, int] = {}
    return tuple(index.setdefault(n, len(index)) for n in nodes)


class GroupPlanMemo:
    """The plans of shard groups, by everything their cost model (`CostModel.group_model`) is
    made of but its `meta` (which only labels plans: `groups._assemble` takes the cluster's own),
    and the planner's options.

    `cephalo advise` plans many clusters of the same offers, and their groupings repeat groups:
    the node of 16 L4s beside 32 T4s or beside 8 A6000s is, in two groups on the same links,
    the same sub-model (the 6 x 32 search's 137 groups were 49 distinct ones). A group's plan
    at b samples depends on nothing else, so each is made once. The key holds the hashable
    parts as they are; the model's profiles (unhashable, and built afresh per cluster) are
    interned by equality. Node ids are renumbered in order of appearance, as `group_key` does
    for the groups of one grouping (only which ranks share a node enters the cost model)."""

    def __init__(self) -> None:
        self._plans: dict[tuple, Plan | None] = {}
        self._profiles: dict[str, list[Any]] = {}
        self.hits = 0
        """Plans served from the memo (tests and the profile count them)."""

    def _profile_id(self, type_key: str, profile: Any) -> int:
        seen = self._profiles.setdefault(type_key, [])
        for i, p in enumerate(seen):
            if p == profile:
                return i
        seen.append(profile)
        return len(seen) - 1

    def key(self, cm: CostModel, planner_kw: dict) -> tuple:
        """Equal for two group models that plan identically (see the class docstring)."""
        devices = tuple((d.type_key, int(d.memory_bytes)) for d in cm.devices)
        types = sorted({t for t, _ in devices})
        profiles = tuple((t, self._profile_id(t, cm.profiles[t])) for t in types)
        host = None
        if cm.host is not None:
            host = (
                _renumbered(cm.host.node_of),
                tuple(cm.host.memory_bytes[n] for n in cm.host.node_of),
                cm.host.optimizer_s_per_param,
            )
        links = None
        if cm.links is not None:
            links = (
                cm.links.intra_bytes_per_s,
                cm.links.inter_bytes_per_s,
                cm.links.latency_s,
                _renumbered(cm.links.node_of),
            )
        return (
            type(cm),
            cm.model,
            cm.seq_len,
            cm.dtype,
            devices,
            profiles,
            (cm.comm.bytes_per_s, cm.comm.latency_s),
            cm.reserve_bytes,
            cm.reserve_fraction,
            cm.reserve_extra_bytes,
            host,
            cm.serial_reduce,
            cm.adapter,
            links,
            cm.cross_reduce,
            cm.padded_collectives,
            tuple(sorted(planner_kw.items())),
        )

    def plan(
        self, key: tuple, cm: CostModel, b: int, planner_kw: dict, tables: TableCache | None = None
    ) -> Plan | None:
        """The best plan at b samples (None where none fits) of the group `cm` whose `key` is
        given, made once per key (with `tables`: `cm`'s tables made before)."""
        key = (key, b)
        if key in self._plans:
            self.hits += 1
            return self._plans[key]
        made = self._plans[key] = _group_plan(cm, b, planner_kw, tables)
        return made


@dataclass
class StepCurve:
    """T(b) of one kind of shard group: the predicted step of its best plan at b samples
    (inf where none fits), for b = 1..bmax, each computed once."""

    cm: CostModel
    bmax: int
    planner_kw: dict = field(default_factory=dict)
    values: dict[int, float] = field(default_factory=dict)
    plans: dict[int, Plan] = field(default_factory=dict)
    memo: GroupPlanMemo | None = None
    """Plans of identical groups made before (by other groupings or other clusters' plans);
    `values` still records this curve's own evaluations, so the search takes the same steps
    and counts the same plans with or without it."""
    _memo_key: tuple | None = field(default=None, repr=False)
    _tables: TableCache = field(init=False, repr=False)
    """The rank tables of this curve's plans: each plan at another b repeats many of them."""

    def __post_init__(self) -> None:
        self._tables = TableCache(self.cm)

    def __call__(self, b: int) -> float:
        if b <= 0:
            return -math.inf
        if b > self.bmax:
            return math.inf
        if b not in self.values:
            if self.memo is not None:
                if self._memo_key is None:  # the key compares profiles: once per curve
                    self._memo_key = self.memo.key(self.cm, self.planner_kw)
                plan = self.memo.plan(self._memo_key, self.cm, b, self.planner_kw, self._tables)
            else:
                plan = _group_plan(self.cm, b, self.planner_kw, self._tables)
            if plan is None:
                self.values[b] = math.inf
            else:
                self.values[b] = plan.predicted.step_s
                self.plans[b] = plan
        return self.values[b]

    def plan(self, b: int) -> Plan:
        if not math.isfinite(self(b)):
            raise PlanDoesNotFit(f"no plan of this group fits {b} samples")
        return self.plans[b]

    @property
    def evaluations(self) -> int:
        """How many plans of this kind were made (tests bound it)."""
        return len(self.values)

    def bracket(self, t: float) -> tuple[int, int]:
        """(lo, hi) from the values known: lo the largest evaluated b with T(b) <= t (0 if
        none), hi the least evaluated b above lo with T(b) > t (bmax + 1 if none)."""
        lo = max((b for b, v in self.values.items() if v <= t), default=0)
        hi = min((b for b, v in self.values.items() if b > lo and v > t), default=self.bmax + 1)
        return lo, hi

    def locate(self, t: float, guess: int) -> int:
        """maxB(t), the largest b with T(b) <= t (0 if none); T(maxB) and T(maxB + 1) are
        evaluated on return (where in 1..bmax).

        A group of n ranks steps up every n samples or so (one more sample on each rank) and
        stays nearly flat in between, so maxB(t) is most often a multiple of n: the search
        tries the multiple of n nearest `guess` and the sample after it, gallops by multiples
        of n from there, and bisects the bracket left."""
        lo, hi = self.bracket(t)
        n = len(self.cm.devices)
        m = n * round(guess / n)
        step = n
        while hi - lo > 1:
            m = min(max(m, lo + 1), hi - 1)
            if self(m) <= t:
                lo = m
                if hi - lo > 1 and self(m + 1) > t:
                    hi = m + 1
                m += step
            else:
                hi = m
                m -= step
            step *= 2
            if not lo < m < hi:
                break  # galloped past the bracket's other end: bisect what is left
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self(mid) <= t:
                lo = mid
            else:
                hi = mid
        return lo

    def rate(self, b: int) -> float:
        """Samples per second of step the group adds near b samples: its ranks' compute
        speeds at an even share of b (the cost model; only to guess where to plan)."""
        cm = self.cm
        ref = max(1, b // len(cm.devices))
        total = 0.0
        for d in cm.devices:
            _, compute, _ = cm.step_time_parts(d.type_key, ref, ref, False)
            total += ref / float(compute) if float(compute) > 0 else 0.0
        return total

    def line(self, b: float, rate: float) -> tuple[float, float, float]:
        """(b0, T(b0), slope in samples per second) of a line through the curve near b: the
        secant of the known stair tops (multiples of the group's size) nearest b on either
        side, or `rate` through the nearest one."""
        n = len(self.cm.devices)
        tops = sorted(
            (x, v) for x, v in self.values.items() if math.isfinite(v) and x % n == 0
        ) or sorted((x, v) for x, v in self.values.items() if math.isfinite(v))
        below = [xv for xv in tops if xv[0] <= b]
        above = [xv for xv in tops if xv[0] > b]
        pair = below[-1:] + above[:1]
        if len(pair) < 2:
            pair = tops[-2:] if not above else tops[:2]
        if len(pair) == 2 and pair[1][1] > pair[0][1]:
            (b0, v0), (b1, v1) = pair
            return b0, v0, (b1 - b0) / (v1 - v0)
        b0, v0 = min(tops, key=lambda xv: abs(xv[0] - b))
        return b0, v0, rate

    def guess(self, t: float, rate: float) -> int:
        """maxB(t) by the line through the known point whose step is nearest t."""
        known = [(b, v) for b, v in self.values.items() if math.isfinite(v)]
        if not known:
            return 1
        b0, v0 = min(known, key=lambda bv: (abs(bv[1] - t), bv[0]))
        b0, v0, r = self.line(b0, rate)
        est = b0 + (t - v0) * r if r > 0 else (b0 if v0 > t else self.bmax)
        return int(min(max(math.floor(est), 1), self.bmax))


def split_batch(curves: list[StepCurve], counts: list[int], B: int) -> tuple[float, list[int]]:
    """(T*, per kind maxB(T*)) for `counts[k]` groups of kind `k` sharing `B` samples (see the
    module docstring); T* is inf when no split fits (some kind cannot hold 1 sample)."""
    g = sum(counts)
    p = max(1, B // g)
    sizes = [len(c.cm.devices) for c in curves]
    # 1. one plan per kind at the stair top nearest the even share (less where it does not
    # fit), and a line through it of the slope its devices' compute speed gives
    anchors = []
    for c, n in zip(curves, sizes, strict=True):
        q = min(max(1, n * (p // n)), c.bmax)
        if not math.isfinite(c(q)) and not math.isfinite(c(1)):
            return math.inf, [0] * len(curves)  # cannot hold a replica: no need to look further
        while q > 1 and not math.isfinite(c(q)):
            q //= 2
        anchors.append(q)
    rates = [c.rate(q) for c, q in zip(curves, anchors, strict=True)]
    lines = [(q, c(q), r) for c, q, r in zip(curves, anchors, rates, strict=True)]
    # 2. the t at which the lines' batches sum to B; a plan of each kind at the stair top its
    # line predicts there, and the lines through the stair tops nearest it, until they agree
    t = _line_t(lines, counts, sizes, B)
    for _ in range(REFINE_ROUNDS):
        fresh = False
        for k, (c, n) in enumerate(zip(curves, sizes, strict=True)):
            b0, v0, r = lines[k]
            est = b0 + (t - v0) * r
            top = int(min(max(n * math.floor(est / n), 1), c.bmax))
            fresh |= top not in c.values
            c(top)
            lines[k] = c.line(est, rates[k])
        t = _line_t(lines, counts, sizes, B)
        if not fresh:
            break
    # the stair tops on either side of each line's batch at t; the least known step at which
    # the known points hold B bounds T* from above (maxB(v) >= every known b with T(b) <= v):
    # the walk starts there, a few values above T*
    for c, n, (b0, v0, r) in zip(curves, sizes, lines, strict=True):
        top = n * math.floor((b0 + (t - v0) * r) / n)
        for b in (top, top + n):
            if 1 <= b <= c.bmax:
                c(b)
    upper = _known_upper_bound(curves, counts, B)
    t = upper if math.isfinite(upper) else t
    # locate every curve at t exactly (raising t where a group would go without samples)
    s = [c.locate(t, c.guess(t, r)) for c, r in zip(curves, rates, strict=True)]
    while min(s) < 1:
        t = max(c(1) for c in curves)
        s = [c.locate(t, c.guess(t, r)) for c, r in zip(curves, rates, strict=True)]
    # 3. the walk to T*
    return _walk(curves, counts, s, B)


def _known_upper_bound(curves, counts, B) -> float:
    """The least evaluated step v with sum_k c_k (largest evaluated b with T_k(b) <= v) >= B."""
    for v in sorted({v for c in curves for v in c.values.values() if math.isfinite(v)}):
        held = sum(
            n * max((b for b, x in c.values.items() if x <= v), default=0)
            for n, c in zip(counts, curves, strict=True)
        )
        if held >= B:
            return v
    return math.inf


def _line_t(lines, counts, sizes, B) -> float:
    """The least t at which the lines' batches, rounded down to stair tops (multiples of the
    group's size n: b_k(t) = n floor((b0_k + (t - v0_k) r_k) / n)), hold B: c_k groups each."""

    def held(t: float) -> float:
        total = 0.0
        for c, n, (b0, v0, r) in zip(counts, sizes, lines, strict=True):
            total += c * n * math.floor(max(0.0, b0 + (t - v0) * r) / n)
        return total

    if not all(r > 0 and math.isfinite(r) for _, _, r in lines):
        return max(v0 for _, v0, _ in lines)
    lo = min(v0 - b0 / r for b0, v0, r in lines)
    hi = max(v0 + (B + n - b0) / r for (b0, v0, r), n in zip(lines, sizes, strict=True))
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if held(mid) >= B:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-12 * hi:
            break
    return hi


def _walk(curves, counts, s, B) -> tuple[float, list[int]]:
    """From maxB_k(t) = s_k for some t (every s_k >= 1), the exact T* and maxB_k(T*)."""
    F = sum(n * b for n, b in zip(counts, s, strict=True))
    if F < B:
        while True:  # up: the least next value, taken by every kind that reaches it
            v = min(c(b + 1) for c, b in zip(curves, s, strict=True))
            if not math.isfinite(v):
                return math.inf, s
            s = [c.locate(v, b + len(c.cm.devices)) for c, b in zip(curves, s, strict=True)]
            if sum(n * b for n, b in zip(counts, s, strict=True)) >= B:
                return v, s
    while True:  # down: drop the largest value in use while the rest still hold B
        w = max(c(b) for c, b in zip(curves, s, strict=True))
        below = math.nextafter(w, -math.inf)
        lower = [c.locate(below, b) for c, b in zip(curves, s, strict=True)]
        if min(lower) < 1 or sum(n * b for n, b in zip(counts, lower, strict=True)) < B:
            return w, s
        s = lower
