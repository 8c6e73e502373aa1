"""The advisor: which GPUs to rent or buy for a model, and what each device in a cluster is worth.

Every count vector x over the offers (how many of each, `cephalo.specs.offers`) is a
cluster of nodes, and its throughput is the planner's (`make_hierarchical_plan`: the flat
plan or shard groups, through the same cost-model factory and options `cephalo plan` uses;
`advise/clusters.py`). The advisor finds the Pareto frontier of price per hour
against throughput over all of them, planning few (docs/advise.md has the long form):

**Bound.** In a cluster of n devices whose slowest link is W, a rank taking b samples needs
at least L_j(b) = `CostModel.step_time_of_passes` of the fastest passes of b samples on its
type j (every micro-batch the planner may use, each pass minimised on its own, no offload;
`fastest_pass_times`): the planner's step time only grows with each pass, offload only adds
copies. At step time T a device of type j thus takes at most beta_j(T) = max{b : L_j(b) <= T}
samples, so the planner's step time is at least T_lb(x) = min{T >= L(0) : sum_j x_j
beta_j(T) >= B} and its throughput at most B / T_lb(x). A cluster also needs sum_j x_j
min(sigma_j, 1) >= 1, where sigma_j is the state fraction a device of type j can hold
without samples (the planner's capacity at b = 0, which caps it at every b); a type with
sigma_j < 0 cannot take part in any plan and is left out. With shard groups a rank's
collectives run over its group only, plus the all-reduce between the groups: a cluster's bound
is the best of its flat plan's and each candidate grouping's (`advise_bound.py`, which holds
the tables L_j and the bounds of complete and partial clusters).

**Search.** Best first in price: a heap of partial count vectors (offer by offer), keyed by
a lower bound on the price of their completions, so clusters are met cheapest first and the
best throughput f below a price is known when a cluster of that price is met. A cluster is
planned only if its bound reaches f (the frontier needs more than f); a partial vector is
expanded only if some completion can: with the partial's device count and links (a
completion has more devices and no faster link, so every beta_j only shrinks; with shard
groups beta_j is the larger of that and the most any group lets a rank of offer j take, and
one node, the cluster's last, may take more: `BoundTables.betas`, `advise_partial.py`), the
samples and the state the remaining offers must add are two covering constraints, and their
cheapest fractional (LP) cover bounds the completion's price from below, or proves that none
can. Each pruning is exact, so the frontier equals planning
every count vector (`exhaustive_frontier`, and tests/test_advise.py on every inventory of up
to 4 types x 4).

**Tolerance.** A frontier can have thousands of points (6 types x 64 GPUs: 7.5e10 clusters).
After `plans_per_level` planner calls at one tolerance g the search continues with g doubled
(from 0 to `FIRST_TOLERANCE`): a cluster is then planned only if its bound beats (1 + g) f.
So every cluster the search skipped has at most (1 + g) times the throughput of the frontier
at its price (`SearchBound`), and the frontier is exact below the price where g first rose.

**Marginal value.** For one cluster: per group of identical devices, the throughput without
one of them (and whether it pays for itself: the cluster's price per token is lower with it
than without), and per offer the throughput with one more unit (the best device to add next).
"""

from __future__ import annotations

import copy
import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from cephalo.advise.bound import STATE_SLACK, BoundTables, Cover, TypeBound, flat_ring, solo_bound
from cephalo.advise.clusters import (
    PlanOptions,
    cluster_of,
    planned_samples_per_s,
    renumber,
    with_new_node,
)
from cephalo.advise.partial import Tails, completion_nodes
from cephalo.advise.results import (
    Addition,
    Advice,
    DeviceValue,
    FrontierPoint,
    Marginal,
    Search,
    SearchBound,
    SearchStats,
    best_under_budget,
    cheapest_meeting_target,
    fewer_first,
    select_frontier,
)
from cephalo.costmodel.model import CostModel
from cephalo.errors import CephaloError
from cephalo.planner.group_split import GroupPlanMemo
from cephalo.planner.search.rank_tables import MAX_MICRO_BATCH, MEMORY_SLACK_BYTES
from cephalo.planner.shard_groups import Grouping
from cephalo.specs.cluster import (
    CPU_COLLECTIVE_LATENCY_S,
    GPU_COLLECTIVE_LATENCY_S,
    Cluster,
)
from cephalo.specs.offers import MICRO_USD_PER_USD, Offer, Offers

CostModelFactory = Callable[[str], CostModel]
"""A cost model for a cluster spec string: what `cephalo plan --cluster SPEC` plans with."""

PLANS_PER_LEVEL = 150
"""Planner calls at one tolerance before the search doubles it (None: never, exact)."""
FIRST_TOLERANCE = 0.005
"""The tolerance after the first `PLANS_PER_LEVEL` exact planner calls."""
BOUND_SLACK = 1e-9
"""Relative margin on every bound test: a cluster is skipped only when its bound is below
the threshold by more than floating-point noise."""
_HUGE_T = float(np.finfo(np.float64).max)
"""Step time standing for "no threshold yet" (beta counts every finite L_j(b))."""


# ====================================================================== the advisor
class Advisor:
    """The clusters `offers` allow for one model, global batch, sequence length and dtype.

    `cost_model_for(spec)` must build the cost model `cephalo plan --cluster spec` plans
    with (commands/advise.py passes `build_cost_model` itself); every throughput reported is
    `make_hierarchical_plan` on it (`hierarchy=False`: the flat plan, as `--no-hierarchy`)."""

    def __init__(
        self,
        offers: Offers,
        cost_model_for: CostModelFactory,
        global_batch: int,
        allow_offload: bool = True,
        allow_host_state: bool = True,
        hierarchy: bool = True,
        reduce_dtype: str = "fp32",
    ):
        if global_batch < 1:
            raise CephaloError(f"the global batch must be >= 1, got {global_batch}")
        self.all_offers = offers
        self.cost_model_for = cost_model_for
        self.global_batch = global_batch
        self.allow_offload = allow_offload
        self.allow_host_state = allow_host_state
        self.options = PlanOptions(allow_offload, allow_host_state, hierarchy, reduce_dtype)
        self.left_out: list[str] = []
        """Why an offer takes no part (no profile for the model, too little memory)."""
        self._cache: dict[str, float | None] = {}
        self._group_plans = GroupPlanMemo()
        """Shard groups' plans: the clusters' groupings repeat groups (planned once each)."""
        self._errors: dict[str, str] = {}
        self.plans = 0
        self.planner_s = 0.0
        self.types: dict[str, TypeBound] = {}
        self._profiles: dict = {}
        self._model_cm: CostModel | None = None
        notes: dict[str, str | None] = {}
        for o in offers:
            if o.type not in notes:
                notes[o.type] = self._probe(o.type)
        for type_key, note in notes.items():
            if note:
                names = ", ".join(o.name for o in offers if o.type == type_key)
                self.left_out.append(f"{names}: {note}")
        self.offers: list[Offer] = [o for o in offers if o.type in self.types]
        if not self.offers or self._model_cm is None:
            raise CephaloError(
                f"{offers.where}: no offer can run this model: " + "; ".join(self.left_out)
            )
        base = self._model_cm
        self.seq_len = base.seq_len
        self.model_name = base.model.name
        self._unit_gpus = np.array([o.unit_gpus for o in self.offers], dtype=np.int64)
        self._unit_price = np.array(
            [o.micro_usd_per_gpu * o.unit_gpus for o in self.offers], dtype=np.int64
        )
        self._max_units = np.array([o.max_units for o in self.offers], dtype=np.int64)
        self._state_cap = np.array([self.types[o.type].state_cap for o in self.offers])
        # the least collective latency a cluster of these offers has (`Cluster`: a cluster with
        # a CPU device has the CPU's, a GPU-only one the GPU's): a bound may charge no more
        self._latency = (
            GPU_COLLECTIVE_LATENCY_S
            if any(o.type != "cpu" for o in self.offers)
            else CPU_COLLECTIVE_LATENCY_S
        )
        self._bounds = BoundTables(
            base,
            self._profiles,
            self.types,
            self.offers,
            global_batch,
            self._latency,
            hierarchy,
            reduce_dtype,
            allow_host_state,
        )
        """The bound's tables, and the bounds of complete and partial clusters."""
        # the same as Python ints, for the search's scalar loops
        self._unit_gpus_list: list[int] = self._unit_gpus.tolist()
        self._unit_price_list: list[int] = self._unit_price.tolist()
        self._max_units_list: list[int] = self._max_units.tolist()
        self._state_lp = [self._lp_cover(d, self._state_cap) for d in range(len(self.offers) + 1)]
        # completion_nodes' part for the offers not fixed yet, per (fixed offers, nodes)
        self._tails: Tails = {}

    # ------------------------------------------------------------------ set-up
    def _probe(self, type_key: str) -> str | None:
        """Build the type's one-device cost model and its bound data; a note if it cannot take part."""
        try:
            cm = self.cost_model_for(type_key)
        except CephaloError as e:
            first = str(e).splitlines()[0].split(". ")[0].rstrip(".")
            return f"left out, {first}"
        if self._model_cm is None:
            self._model_cm = cm
        B = self.global_batch
        cap = cm.capacity_bytes(0)
        # the leanest memory the planner may choose: no reduce overlap (one unit gradient
        # less), and where the cost model has host resources, every state byte but the
        # compute-dtype copy on the host (host memory left unbounded: an upper bound)
        leanest = (True, False)
        idle = min(
            float(cm.memory_without_state(type_key, cap, 0, 1, False, overlap))
            for overlap in leanest
        )
        per_fraction = (
            cm.host_part_device_bytes_per_fraction
            if self.allow_host_state and cm.host is not None and not cm.adapter.frozen_base
            else cm.bytes_per_fraction
        )
        state_cap = (cap - MEMORY_SLACK_BYTES - idle) / per_fraction
        if state_cap < 0:
            return (
                f"left out, its {cap / 1024**3:.0f} GiB cannot hold even the buffers of "
                f"{cm.model.name} at seq {cm.seq_len} / {cm.dtype} ({idle / 1024**3:.1f} GiB before any state)"
            )
        ms = np.arange(1, min(B, MAX_MICRO_BATCH) + 1)
        options = [False, True] if self.allow_offload else [False]
        mem = np.min(
            [
                cm.memory_without_state(type_key, cap, ms, ms, o, overlap)
                for o in options
                for overlap in leanest
            ],
            axis=0,
        )
        fits = np.nonzero(mem + MEMORY_SLACK_BYTES <= cap)[0]
        mmax = int(ms[fits[-1]]) if fits.size else 0
        passes = cm.fastest_pass_times(type_key, np.arange(B + 1), max(mmax, 1))
        # (b up to B: the planner never puts more than MAX_BATCH_PER_RANK on one rank, so
        # counting larger b only loosens the bound)
        self.types[type_key] = TypeBound(
            type_key,
            cap,
            mmax,
            min(state_cap, 1.0),
            passes,
            solo_bound(cm, type_key, B, ms, mem, idle, self.allow_host_state),
        )
        self._profiles.update(cm.profiles)
        return None

    # ------------------------------------------------------------------ clusters
    def cluster_of(self, units: Sequence[int]) -> Cluster:
        """The cluster of `units[j]` units (nodes, or GPUs) of each offer (each offer on its own
        node or nodes, `advise_clusters.cluster_of`)."""
        return cluster_of(self.offers, units)

    def price_of(self, units: Sequence[int]) -> int:
        """Micro-USD per hour."""
        return int(np.dot(self._unit_price, np.asarray(units, dtype=np.int64)))

    def samples_per_s(self, spec: str) -> float | None:
        """The planner's throughput for the cluster spec (None: the model does not fit); cached."""
        if spec not in self._cache:
            started = time.perf_counter()
            cm = self.cost_model_for(spec)  # a bad spec or model is the user's to hear about
            try:
                self._cache[spec] = planned_samples_per_s(
                    cm, self.global_batch, self.options, self._grouping_floor, self._group_plans
                )
            except CephaloError as e:  # does not fit, or more samples per GPU than it plans
                self._cache[spec] = None
                self._errors[spec] = str(e)
            self.plans += 1
            self.planner_s += time.perf_counter() - started
        return self._cache[spec]

    def _grouping_floor(self, cm: CostModel, grouping: Grouping) -> float:
        """The bound's least step of a plan of `cm`'s cluster in these shard groups: the planner
        skips groupings that cannot beat the best plan (the answer stays the planner's)."""
        return self._bounds.grouping_floor(cm, grouping.groups)

    def does_not_fit_reason(self, spec: str) -> str | None:
        self.samples_per_s(spec)
        return self._errors.get(spec)

    def point(self, units: Sequence[int], samples_per_s: float) -> FrontierPoint:
        cluster = self.cluster_of(units)
        return FrontierPoint(
            counts={
                o.name: int(k) * o.unit_gpus for o, k in zip(self.offers, units, strict=True) if k
            },
            cluster=cluster.to_spec(),
            description=cluster.describe(),
            price_per_hour=self.price_of(units) / MICRO_USD_PER_USD,
            samples_per_s=samples_per_s,
            tokens_per_s=samples_per_s * self.seq_len,
        )

    def limited_to(self, max_counts: dict[str, int]) -> Advisor:
        """The same advisor over at most `max_counts[name]` GPUs of the named offers (0: not
        offered; others unchanged), sharing the planner's answers and the bound's tables."""
        unknown = set(max_counts) - {o.name for o in self.offers}
        if unknown:
            raise CephaloError(f"no offer named {', '.join(sorted(unknown))}")
        clone = copy.copy(self)
        units = []
        for o, k in zip(self.offers, self._max_units, strict=True):
            gpus = max_counts.get(o.name, int(k) * o.unit_gpus)
            if gpus < 0 or gpus % o.unit_gpus:
                raise CephaloError(
                    f"{o.name}: {gpus} is not a whole number of its {o.unit_gpus}-GPU nodes"
                )
            units.append(min(gpus // o.unit_gpus, o.max_units))
        clone._max_units = np.array(units, dtype=np.int64)
        clone._max_units_list = [int(k) for k in units]
        clone._state_lp = [
            clone._lp_cover(d, clone._state_cap) for d in range(len(clone.offers) + 1)
        ]
        return clone

    @property
    def clusters(self) -> int:
        return int(np.prod(self._max_units + 1)) - 1

    # ------------------------------------------------------------------ the bound
    def _partial_betas(
        self,
        units: tuple[int, ...],
        n: int,
        intra: float,
        inter: float,
        nodes: int,
        T: float,
        top: int | None = None,
    ) -> tuple[list[Cover], float]:
        """The covers of the completions of the partial cluster `units` within T (n devices on
        `nodes` nodes, these links; `top`: its last count stands for those up to top): per kind
        of plan, per offer the most samples one of its GPUs takes, flat or in shard groups, and
        what one node may add (`BoundTables.betas`); and the least collective floor L(0)."""
        ring = flat_ring(n, intra, inter, nodes)
        nb = completion_nodes(self.offers, units, nodes, top=top, tails=self._tails)
        return self._bounds.betas(ring, T, (intra, inter), nb)

    def upper_bound(self, units: Sequence[int]) -> float:
        """B / T_lb: no plan of this cluster exceeds this many samples/s (0: cannot fit)."""
        x = np.asarray(units, dtype=np.int64)
        gpus = x * self._unit_gpus
        if float(np.dot(gpus, self._state_cap)) < 1 - STATE_SLACK or gpus.sum() == 0:
            return 0.0
        _, intra, inter, _ = self._shape(x)
        t = self._bounds.step_lower_bound(x, intra, inter)
        if not math.isfinite(t):
            return 0.0
        return self.global_batch / t if t > 0 else math.inf

    def _shape(self, x: np.ndarray) -> tuple[int, float, float, int]:
        """(devices, slowest intra link, slowest inter link, nodes) of a count vector."""
        n, intra, inter, nodes = 0, math.inf, math.inf, 0
        for o, k in zip(self.offers, x, strict=True):
            if k:
                n += int(k) * o.unit_gpus
                intra = min(intra, o.intra_bytes_per_s)
                inter = min(inter, o.inter_node_bytes_per_s)
                nodes += int(k) if o.per_node else 1
        return n, intra, inter, nodes

    def _threshold_time(self, v: float) -> float:
        """The step time a cluster must beat to reach more than v samples/s (with slack)."""
        if v <= 0:
            return _HUGE_T
        return self.global_batch / (v * (1.0 - BOUND_SLACK))

    def _lp_cover(self, start: int, per_gpu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Breakpoints (capacity, cost) of the cheapest fractional cover by offers start.. whose
        GPUs add `per_gpu` each: piecewise linear and convex in what must be covered."""
        items = []
        # Python numbers, not numpy scalars: the search builds hundreds of thousands of these
        per = per_gpu.tolist()
        for j in range(start, len(self.offers)):
            a = float(per[j]) * self._unit_gpus_list[j]
            if a > 0:
                price, most = self._unit_price_list[j], self._max_units_list[j]
                items.append((price / a, a * most, price * most))
        items.sort(key=lambda it: it[0])
        caps, costs = [0.0], [0.0]
        for _, cap, cost in items:
            caps.append(caps[-1] + cap)
            costs.append(costs[-1] + cost)
        return np.array(caps), np.array(costs, dtype=np.float64)

    @staticmethod
    def _lp_cost(need, curve: tuple[np.ndarray, np.ndarray]):
        """The cheapest fractional cover of `need` (0 when nothing is needed, inf when the
        offers cannot cover it)."""
        caps, costs = curve
        if np.ndim(need) == 0:
            need = float(need)
            if need <= 0:
                return 0.0
            if need > caps[-1]:
                return math.inf
            return float(np.interp(need, caps, costs))
        need = np.asarray(need, dtype=np.float64)
        out = np.interp(need, caps, costs)
        out = np.where(need <= 0, 0.0, out)
        return np.where(need > caps[-1], np.inf, out)

    # ------------------------------------------------------------------ the search
    def search(
        self,
        tolerance: float = 0.0,
        plans_per_level: int | None = PLANS_PER_LEVEL,
        progress: Callable[[int, int, float], None] | None = None,
    ) -> Search:
        """The Pareto frontier of price against throughput (see the module docstring).

        `tolerance` is the starting one; `plans_per_level=None` never raises it (exact, at any
        cost). `progress(plans, frontier points, price reached)` is called after each plan."""
        if tolerance < 0 or not math.isfinite(tolerance):
            raise CephaloError(f"the tolerance must be a number >= 0, got {tolerance}")
        started = time.perf_counter()
        planner_s0 = self.planner_s
        K = len(self.offers)
        B = self.global_batch
        g = float(tolerance)
        levels: list[tuple[float, float]] = [(0.0, g)] if g > 0 else []
        exact_below: float | None = 0.0 if g > 0 else None
        plans_at_level = 0
        planned = 0  # clusters this search asked the planner about (answers may be cached)
        stats = {"skipped": 0, "expanded": 0, "pruned": 0, "requeued": 0}
        frontier: list[tuple[int, tuple[int, ...], float]] = []  # (price, units, samples/s)
        f_closed = 0.0  # best throughput at prices below the current group
        group_price: int | None = None
        group_best: tuple[float, tuple, tuple[int, ...]] | None = None  # (samples/s, key, units)
        seq = itertools.count()
        # node: (depth, units, devices, price, intra, inter, nodes)
        heap: list[tuple[float, int, tuple]] = [
            (0.0, next(seq), (0, (), 0, 0, math.inf, math.inf, 0))
        ]

        def close_group() -> None:
            nonlocal f_closed, group_price, group_best
            if group_best is not None and group_best[0] > f_closed:
                frontier.append((group_price, group_best[2], group_best[0]))
                f_closed = group_best[0]
            group_price, group_best = None, None

        while heap:
            prio, _, node = heapq.heappop(heap)
            at_least = math.ceil(prio - 1e-3)  # completions have whole micro-dollar prices
            if group_price is not None and at_least > group_price:
                close_group()
            depth, units, n, price, intra, inter, nodes = node
            v = (1.0 + g) * f_closed
            if depth == K:
                if n == 0:
                    continue
                group_price = price
                need = max(v, group_best[0] if group_best else 0.0)
                if not self._may_reach(np.asarray(units), intra, inter, need):
                    stats["skipped"] += 1
                    continue
                spec = self.cluster_of(units).to_spec()
                sps = self.samples_per_s(spec)
                planned += 1
                plans_at_level += 1
                if sps is not None:
                    key = (n, units)
                    if group_best is None or (sps, fewer_first(key)) > (
                        group_best[0],
                        fewer_first(group_best[1]),
                    ):
                        group_best = (sps, key, units)
                if progress is not None:
                    progress(planned, len(frontier), price / MICRO_USD_PER_USD)
                if plans_per_level is not None and plans_at_level >= plans_per_level:
                    g = FIRST_TOLERANCE if g == 0 else 2 * g
                    levels.append((price / MICRO_USD_PER_USD, g))
                    if exact_below is None:
                        exact_below = price / MICRO_USD_PER_USD
                    plans_at_level = 0
                continue
            # a partial vector: bound its completions, then push its children
            T = self._threshold_time(v)
            covers, floor = self._partial_betas(units, n, intra, inter, nodes, T)
            if floor > T:
                stats["pruned"] += 1
                continue
            gpus = np.asarray(units, dtype=np.int64) * self._unit_gpus[:depth]
            held = float(np.dot(gpus, self._state_cap[:depth]))
            own = self._completion_cost(depth, units, n, intra, inter, nodes, T, covers, held)
            if not math.isfinite(own):
                stats["pruned"] += 1
                continue
            if price + own > prio + 0.5:  # the bound rose since it was pushed: wait in line
                stats["requeued"] += 1
                heapq.heappush(heap, (price + own, next(seq), node))
                continue
            stats["expanded"] += 1
            o = self.offers[depth]
            u = o.unit_gpus
            c_intra, c_inter = min(intra, o.intra_bytes_per_s), min(inter, o.inter_node_bytes_per_s)
            # children in buckets y = 0, 1, 2-3, 4-7, ...: each bounded with the links and
            # device count of its smallest member, which no member falls below
            for lo, hi in _buckets(int(self._max_units[depth])):
                if lo == 0:
                    b_covers, b_floor = covers, floor
                else:
                    c_nodes = nodes + (lo if o.per_node else 1)
                    b_covers, b_floor = self._partial_betas(
                        (*units, lo), n + lo * u, c_intra, c_inter, c_nodes, T, top=hi
                    )
                    if b_floor > T:
                        stats["pruned"] += hi - lo + 1
                        continue
                ys = np.arange(lo, hi + 1)
                b_held = held + ys * u * self._state_cap[depth]
                state = self._lp_cost(1 - STATE_SLACK - b_held, self._state_lp[depth + 1])
                lower = np.full(ys.shape, np.inf)
                for b_betas, b_extra in b_covers:  # the cheapest kind of plan that may reach T
                    b_cover = (
                        int(np.dot(gpus, b_betas[:depth])) + ys * u * int(b_betas[depth]) + b_extra
                    )
                    samples = self._lp_cost(B - b_cover, self._lp_cover(depth + 1, b_betas))
                    lower = np.minimum(lower, np.maximum(samples, state))
                ok = np.isfinite(lower)
                stats["pruned"] += int((~ok).sum())
                for i in np.nonzero(ok)[0]:
                    y = int(ys[i])
                    child_price = price + y * int(self._unit_price[depth])
                    child = (
                        depth + 1,
                        (*units, y),
                        n + y * u,
                        child_price,
                        c_intra if y else intra,
                        c_inter if y else inter,
                        nodes + ((y if o.per_node else 1) if y else 0),
                    )
                    heapq.heappush(heap, (child_price + float(lower[i]), next(seq), child))
        close_group()
        wall = time.perf_counter() - started
        points = [self.point(u, s) for _, u, s in frontier]
        bound = SearchBound(g, exact_below, levels)
        return Search(
            points,
            bound,
            SearchStats(
                clusters=self.clusters,
                plans=planned,
                wall_s=wall,
                planner_s=self.planner_s - planner_s0,
                **stats,
            ),
        )

    def _completion_cost(
        self,
        depth: int,
        units: tuple[int, ...],
        n: int,
        intra: float,
        inter: float,
        nodes: int,
        T: float,
        covers: list[Cover],
        held: float,
    ) -> float:
        """A lower bound on the extra price (micro-USD) of a completion of the partial vector
        (offers < depth fixed at `units`) whose bound beats step time T; inf if none can.

        Two kinds of completion: the partial itself (nothing added; `covers` are its own) and
        those adding devices. Those have more nodes than the partial (every offer has its own),
        so once it has a node their slowest link is the inter-node one, and at least as many
        devices as it takes to cover the samples still missing: found by covering with the
        partial's tables, then again with tables at that many devices, which only shrink. Each
        kind of plan (`Cover`) is covered on its own; the cheapest bounds them all."""
        B = self.global_batch
        gpus = np.asarray(units, dtype=np.int64) * self._unit_gpus[:depth]
        best = math.inf
        itself = (int(np.dot(gpus, c.betas[:depth])) + c.extra for c in covers)
        if n > 0 and held >= 1 - STATE_SLACK and max(itself) >= B:
            best = 0.0  # the partial alone may already beat T (its floor was checked)
        if depth == len(self.offers) or not any(self._max_units_list[depth:]):
            return best
        link = (
            min(intra, inter)
            if nodes >= 1
            else max(o.intra_bytes_per_s for o in self.offers[depth:])
        )
        nb = completion_nodes(self.offers, units, nodes, added=True, tails=self._tails)
        state = self._lp_cost(1 - STATE_SLACK - held, self._state_lp[depth])
        added = 1
        missing: list[int] = []
        for _ in range(4):
            add_covers, add_floor = self._bounds.betas(
                flat_ring(n + added, link, link, 1), T, (intra, inter), nb
            )
            if add_floor > T:
                return best
            # per kind of plan, the samples the added devices must take; the fewest devices any
            # kind needs
            missing = [B - int(np.dot(gpus, c.betas[:depth])) - c.extra for c in add_covers]
            fewest = min(
                self._fewest_gpus(depth, c.betas, m)
                for c, m in zip(add_covers, missing, strict=True)
            )
            if not math.isfinite(fewest):
                return best
            if fewest <= added:
                break
            added = int(fewest)
        for c, m in zip(add_covers, missing, strict=True):  # the last round's covers
            best = min(best, max(self._lp_cost(m, self._lp_cover(depth, c.betas)), state))
        return best

    def _fewest_gpus(self, start: int, betas: np.ndarray, missing: int) -> float:
        """Fewest GPUs of offers start.. that take `missing` samples (inf: they cannot)."""
        if missing <= 0:
            return 0.0
        count = 0.0
        per = betas.tolist()  # Python ints: called about a million times on 6 x 32 GPUs
        for j in sorted(range(start, len(self.offers)), key=lambda j: -per[j]):
            beta = per[j]
            if beta <= 0:
                break
            avail = self._max_units_list[j] * self._unit_gpus_list[j]
            take = min(avail, missing / beta)
            count += take
            missing -= take * beta
            if missing <= 1e-9:
                return float(math.ceil(count - 1e-9))
        return math.inf

    def _may_reach(self, x: np.ndarray, intra: float, inter: float, v: float) -> bool:
        """Can this cluster's bound reach v samples/s (and its state fit)?"""
        gpus = x * self._unit_gpus
        if float(np.dot(gpus, self._state_cap)) < 1 - STATE_SLACK:
            return False
        return self._bounds.reaches(x, intra, inter, self._threshold_time(v))

    # ------------------------------------------------------------------ reference
    def exhaustive_frontier(self) -> list[FrontierPoint]:
        """Plan every count vector and keep the Pareto frontier (the reference the search
        must equal; slow: one planner call per cluster)."""
        records = []
        for units in itertools.product(*(range(k + 1) for k in self._max_units)):
            n = int(np.dot(units, self._unit_gpus))
            if n == 0:
                continue
            sps = self.samples_per_s(self.cluster_of(units).to_spec())
            if sps is not None:
                records.append((self.price_of(units), sps, (n, tuple(units))))
        return [self.point(key[1], sps) for _, sps, key in select_frontier(records)]

    # ------------------------------------------------------------------ marginal values
    def marginal(
        self, base: str, units: Sequence[int] | None = None, have: Cluster | None = None
    ) -> Marginal:
        """Marginal values for a cluster of the offers (`units`) or an owned one (`have`)."""
        if (units is None) == (have is None):
            raise CephaloError("internal: marginal values need either units or have")
        if units is not None:
            cluster = self.cluster_of(units)
            owners: list[Offer | None] = []
            for o, k in zip(self.offers, units, strict=True):
                owners.extend([o] * (int(k) * o.unit_gpus))
        else:
            cluster = have
            owners = [self._cheapest_offer(d.type) for d in have.devices]
        spec = cluster.to_spec()
        sps = self.samples_per_s(spec)
        if sps is None:
            raise CephaloError(
                f"{cluster.describe()} cannot train {self.model_name} at global batch "
                f"{self.global_batch}: {self.does_not_fit_reason(spec)}"
            )
        prices = [o.price_per_hour if o else None for o in owners]
        total = None if any(p is None for p in prices) else sum(prices)
        values = []
        groups: dict[tuple, list[int]] = {}
        for i, d in enumerate(cluster.devices):
            o = owners[i]
            groups.setdefault((d.type_key, d.memory_bytes, o.name if o else None), []).append(i)
        for (type_key, _mem, offer_name), idx in groups.items():
            drop = idx[-1]  # from the group's last node
            rest = [d for i, d in enumerate(cluster.devices) if i != drop]
            if rest:
                without = Cluster(
                    renumber(rest),
                    intra_node_bytes_per_s=cluster.intra_node_bytes_per_s,
                    inter_node_bytes_per_s=cluster.inter_node_bytes_per_s,
                    collective_latency_s=cluster.collective_latency_s,
                )
                w_spec = without.to_spec()
                w_sps = self.samples_per_s(w_spec) or 0.0
            else:
                w_spec, w_sps = "", 0.0
            p = prices[drop]
            pays = None
            if p is not None and total is not None:
                pays = True if w_sps <= 0 else total / sps <= (total - p) / w_sps
            lost = (sps - w_sps) * self.seq_len
            values.append(
                DeviceValue(
                    type=type_key,
                    offer=offer_name,
                    count=len(idx),
                    price_per_hour=p,
                    cluster_without=w_spec,
                    samples_per_s_without=w_sps,
                    tokens_per_s_lost=lost,
                    share_lost=lost / (sps * self.seq_len),
                    pays_for_itself=pays,
                )
            )
        additions = []
        for j, o in enumerate(self.offers):
            if units is not None:
                if units[j] >= self._max_units[j]:
                    continue
                more = list(units)
                more[j] += 1
                with_cluster = self.cluster_of(more)
            else:
                with_cluster = with_new_node(cluster, o)
            s_with = self.samples_per_s(with_cluster.to_spec()) or 0.0
            price = o.price_per_hour * o.unit_gpus
            gained = (s_with - sps) * self.seq_len
            additions.append(
                Addition(
                    offer=o.name,
                    type=o.type,
                    gpus=o.unit_gpus,
                    price_per_hour=price,
                    cluster_with=with_cluster.to_spec(),
                    samples_per_s_with=s_with,
                    tokens_per_s_gained=gained,
                    tokens_per_s_per_usd=gained / price
                    if price > 0
                    else (math.inf if gained > 0 else 0.0),
                )
            )
        label = (
            " + ".join(
                f"{int(k) * o.unit_gpus}x {o.name}"
                for o, k in zip(self.offers, units, strict=True)
                if k
            )
            if units is not None
            else cluster.describe()
        )
        return Marginal(
            base=base,
            cluster=spec,
            description=cluster.describe(),
            label=label,
            price_per_hour=total,
            samples_per_s=sps,
            tokens_per_s=sps * self.seq_len,
            devices=values,
            additions=additions,
        )

    def _cheapest_offer(self, type_key: str) -> Offer | None:
        same = [o for o in self.offers if o.type == type_key]
        return min(same, key=lambda o: o.price_per_hour, default=None)

    def units_of(self, point: FrontierPoint) -> list[int]:
        return [point.counts.get(o.name, 0) // o.unit_gpus for o in self.offers]


# ====================================================================== helpers
def _buckets(max_units: int) -> list[tuple[int, int]]:
    """0, 1, 2-3, 4-7, ... up to max_units."""
    out, lo = [(0, 0)], 1
    while lo <= max_units:
        out.append((lo, min(2 * lo - 1, max_units)))
        lo *= 2
    return out


def advise(
    advisor: Advisor,
    budget: float | None = None,
    target_tokens_per_s: float | None = None,
    have: Cluster | None = None,
    tolerance: float = 0.0,
    plans_per_level: int | None = PLANS_PER_LEVEL,
    progress: Callable[[int, int, float], None] | None = None,
) -> Advice:
    """The frontier, the best cluster under the budget, the cheapest meeting the target, and
    the marginal values of the chosen cluster (the best under the budget, else the cheapest
    meeting the target, else the lowest price per token) and of `have`."""
    if budget is not None and not (math.isfinite(budget) and budget >= 0):
        raise CephaloError(f"--budget must be a number of USD per hour >= 0, got {budget}")
    if target_tokens_per_s is not None and not (
        math.isfinite(target_tokens_per_s) and target_tokens_per_s > 0
    ):
        raise CephaloError(
            f"--target-tokens-per-s must be a positive number, got {target_tokens_per_s}"
        )
    found = advisor.search(tolerance, plans_per_level, progress)
    model, B = advisor.model_name, advisor.global_batch
    if not found.frontier:
        everything = advisor.cluster_of(list(advisor._max_units)).to_spec()
        reason = advisor.does_not_fit_reason(everything) or "the planner found no split"
        raise CephaloError(
            f"no cluster the offers allow can train {model} at global batch {B}, not even all of "
            f"them ({advisor.cluster_of(list(advisor._max_units)).describe()}): {reason}"
        )
    frontier = found.frontier
    problems = []
    under = None if budget is None else best_under_budget(frontier, budget)
    meeting = (
        None
        if target_tokens_per_s is None
        else cheapest_meeting_target(frontier, target_tokens_per_s)
    )
    if budget is not None and under is None:
        first = frontier[0]
        problems.append(
            f"no cluster the offers allow fits {model} within ${budget:,.2f}/h at global batch {B}: "
            f"the cheapest that does is {first.cluster} at ${first.price_per_hour:,.2f}/h "
            f"({first.tokens_per_s:,.0f} tokens/s); raise --budget to at least {first.price_per_hour:.2f}"
        )
    if target_tokens_per_s is not None and meeting is None:
        top = frontier[-1]
        bound = found.bound
        note = (
            ""
            if bound.exact
            else f" (the search's bound allows at most {top.tokens_per_s * (1 + bound.tolerance):,.0f})"
        )
        problems.append(
            f"no cluster the offers allow reaches {target_tokens_per_s:,.0f} tokens/s for {model} at "
            f"global batch {B}: the most is {top.tokens_per_s:,.0f} tokens/s{note}, by {top.cluster} "
            f"at ${top.price_per_hour:,.2f}/h; offer more or faster GPUs, or raise --global-batch "
            "(a GPU adds throughput only with samples to run)"
        )
    if under is not None:
        chosen, why = under, f"the most throughput within ${budget:,.2f}/h"
    elif meeting is not None:
        chosen, why = meeting, f"the cheapest with {target_tokens_per_s:,.0f} tokens/s"
    elif budget is None and target_tokens_per_s is None:
        chosen = min(frontier, key=lambda p: (p.usd_per_million_tokens, p.price_per_hour))
        why = "the lowest price per token"
    else:
        chosen, why = None, ""
    marginal = []
    if chosen is not None:
        marginal.append(advisor.marginal("chosen", units=advisor.units_of(chosen)))
    if have is not None:
        marginal.append(advisor.marginal("have", have=have))
    base = advisor._model_cm
    return Advice(
        model=model,
        global_batch=B,
        seq_len=advisor.seq_len,
        dtype=base.dtype,
        offers=list(advisor.offers),
        left_out=list(advisor.left_out),
        search=found,
        budget=budget,
        target_tokens_per_s=target_tokens_per_s,
        best_under_budget=under,
        cheapest_meeting_target=meeting,
        chosen=chosen,
        chosen_why=why,
        marginal=marginal,
        problems=problems,
    )
