"""The advisor's bound tables: per device type, a lower bound L(b) on a rank's step time at b
samples for the collectives it may run, and from them the bound on a cluster's throughput, flat
or in shard groups (`Advisor.upper_bound`; docs/advise.md, "The search, and why it is exact").

A table is keyed by the collectives a rank takes part in, a `Ring`: a ring of `n` devices over
a link of `link` bytes/s, and (shard groups) the all-reduce between `groups` groups over the
inter-node link `cross` in the advisor's reduce dtype. L(b) = `CostModel.step_time_of_passes`
of the type's fastest passes of b samples (no offload) on a one-type cost model with that ring:
no plan of such a rank steps faster (the planner's step only grows with each pass time, offload
only adds copies; a group's plan is the flat planner's on `CostModel.group_model`, whose ranks
pay the same formula with the cross-group all-reduce in it). L only grows with n, groups, and a
slower link or cross link (each enters a time as bytes / rate or (n - 1) / n and (g - 1) / g
factors, inside sums and maxima), which is what makes the relaxations below valid.

**A complete cluster** (`BoundTables.step_lower_bound`) steps no faster than the least of

- its flat plan's bound: every rank on the ring of all n devices over the slowest link;
- per candidate grouping the planner may try (`groups.candidate_groupings`: one group per
  node, per 2, 4, ... consecutive nodes; the cluster's nodes are known, so the groups are
  too): each rank on its own group's ring (the group's devices, intra-node link for a group on
  one node, the slower of both links otherwise) plus the all-reduce between that many groups
  over the cluster's inter-node link. A grouping with a group whose devices cannot hold a
  replica (state capacities summing below 1) has no plan, and every group takes >= 1 sample.

Each bound is the least T (at least every rank's L(0): ranks without samples still
communicate) at which the ranks' samples max{b : L(b) <= T} sum to the global batch. The
planner returns the best of the flat plan and the groupings it plans (a subset of these), so
the least of these bounds is below its step.

A rank alone in its group (a node of one GPU), or in a cluster of one device, holds the whole
state (a `solo` ring): its micro-batches are only those whose working memory fits beside the
state's leanest bytes, it keeps at least `solo_host_part` of the state on the host (whose
gradients go down in the backward: `step_time_of_passes` with that host part), and its
optimizer phase, which the cost model adds to the step, takes at least `solo_optimizer_s`. On
nodes of one GPU these terms are most of what separates a group's plan from its passes.

The planner skips a grouping once no candidate left can beat the best plan it has
(`grouping_floor`, from the cluster's own cost model, through `make_hierarchical_plan`'s
`step_floor`).

**A partial cluster** (the search's heap holds count vectors fixed for the first offers only)
is bounded through every completion at once, by per-offer samples (`betas`) that no rank of
that offer exceeds in any completion (the flat table's on a ring of the devices a completion has
at least, over the partial's slowest link, or a group's), plus `extra` samples for one node.
What a completion's nodes have is `advise_partial.NodeBounds`; a completion's links are never
faster than the partial's, nor than the offer's own (its node is in the cluster). A rank's group
in any candidate grouping is either

- its node alone: the grouping is one group per node (as many groups as the cluster has nodes:
  at least the partial's, one more for an offer not fixed yet) or the rank's node is the
  cluster's last, the last chunk's only node (`last_alone_groups`: >= 2 groups); its ring holds
  the node's devices (a node of one: `solo`) over the intra-node link. An offer without nodes
  whose count is open has a node of one device or of >= 2: both rings are alternatives (a
  ring of 2 over the fast intra-node link steps faster than a device whose group crosses the
  network, so charging the node 1 device alone is not a bound);
- or spans >= 2 nodes: >= its node's devices + 1 over the slower of both links, >= 2 groups.

Each offer's betas are the most any of these allows but for the last node; only one node is
the cluster's last, so `extra` = max over offers that may own it of its devices x what one of
them may take beyond its betas there. L only grows with n, groups and slower links, so every
rank of every completion is within these: the partial's cover bounds every completion's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from cephalo.advise.partial import NodeBounds
from cephalo.costmodel.model import CostModel
from cephalo.costmodel.shard_groups import CrossReduce
from cephalo.planner.search.rank_tables import MEMORY_SLACK_BYTES
from cephalo.specs.offers import Offer
from cephalo.specs.profile import CommProfile

TABLE_CACHE_BYTES = 64 * 2**20
"""Memory for the cache of the bound's tables."""
STATE_SLACK = 1e-9
"""Devices whose state capacities sum to below 1 - this cannot hold a replica."""


class Ring(NamedTuple):
    """The collectives of one rank: a ring of `n` devices over `link` bytes/s, and (`groups` >
    1) the all-reduce between that many shard groups over `cross` bytes/s. `solo`, where not
    None: the rank is its group's (or cluster's) only device, so it holds the whole state
    (micro-batches as `SoloBound.passes`), and its optimizer phase takes at least `solo`
    seconds (`solo_optimizer_s`)."""

    n: int
    link: float
    groups: int = 1
    cross: float = 0.0
    solo: float | None = None


NO_COLLECTIVES = Ring(1, 0.0)


class Cover(NamedTuple):
    """A bound on the samples of a partial's completions of one kind: per offer the most one of
    its GPUs takes, and what one node may take beyond that."""

    betas: np.ndarray
    extra: int


OfferKey = tuple[int, float, float, int, int, int]
"""One offer's shard-group situation in a partial's completions (`BoundTables._offer_rings`)."""
CountKey = tuple[int, float, float, int, int, int, int]
"""An `OfferKey` and the most devices the offer's node has as the cluster's last (0: never)."""


class OfferRings(NamedTuple):
    """The rings one offer's rank may have in a completion's shard groups (`_offer_rings`)."""

    type: str
    span: Ring
    """In a group spanning nodes."""
    alone: tuple[Ring, ...]
    """Its node alone (alternatives: its samples are at most the most any allows)."""
    last: tuple[Ring, ...]
    """Its node alone as the cluster's last (alternatives)."""
    g_floor: float
    """The least L(0) of span and alone."""
    last_floor: float
    """The least L(0) of last."""


Group = list[tuple[str, int, Ring]]
"""The ranks of one shard group: (device type, GPUs, their ring)."""
Shape = list[Group]
"""A plan's shard groups (one for a flat plan)."""


@dataclass
class TypeBound:
    """What the bound needs of one device type (from its one-device cost model)."""

    key: str
    capacity: int
    max_micro_batch: int
    """Largest micro-batch whose working memory fits (0: not even one sample fits)."""
    state_cap: float
    """State fraction the device holds without samples, at most 1."""
    passes: dict[str, tuple[np.ndarray, np.ndarray]]
    """Per unit kind, the fastest forward and backward of b = 0..B samples."""
    solo: SoloBound | None = None
    """What a device of this type holding the whole state is bound by (None: as any other)."""


@dataclass
class SoloBound:
    """A device that holds the whole state: alone in its shard group, or the whole cluster."""

    max_micro_batch: int
    """Largest micro-batch whose working memory fits beside the whole state (at its leanest)."""
    passes: dict[str, tuple[np.ndarray, np.ndarray]]
    """`TypeBound.passes` with micro-batches of at most `max_micro_batch`."""
    optimizer_s: float
    """The least optimizer phase, on a node of its own (the advisor's clusters: its host not
    shared with other ranks, its speed not overridden)."""
    host_part: float
    """The least part of the state it keeps on the host (`solo_host_part`): its gradients go
    down to the host in the backward."""


def solo_bound(
    cm: CostModel,
    type_key: str,
    batch: int,
    ms: np.ndarray,
    working: np.ndarray,
    idle: float,
    host_state: bool,
) -> SoloBound:
    """The `SoloBound` of a type from its one-device cost model `cm`: `working[i]` is the least
    working memory of a micro-batch of `ms[i]` samples, `idle` that without samples (the
    advisor's leanest choices), `host_state` whether the planner may keep state on the host."""
    hosted = host_state and not cm.adapter.frozen_base
    # the state's leanest device bytes: with host state, its compute-dtype copy and reduce
    # output only, where that is less
    whole = (
        min(cm.bytes_per_fraction, cm.host_part_device_bytes_per_fraction)
        if hosted
        else cm.bytes_per_fraction
    )
    fits = np.nonzero(working + MEMORY_SLACK_BYTES + whole <= cm.capacity_bytes(0))[0]
    mmax = int(ms[fits[-1]]) if fits.size else 0
    host_part = solo_host_part(cm, cm.capacity_bytes(0), idle, hosted)
    # the host AdamW of a node of one rank (this model's cluster): sharing a host only slows it
    host_s = (cm.host.optimizer_s_per_param[0] if cm.host is not None else 0.0) if hosted else None
    return SoloBound(
        mmax,
        cm.fastest_pass_times(type_key, np.arange(batch + 1), max(mmax, 1)),
        solo_optimizer_s(cm, type_key, host_s, host_part),
        host_part,
    )


def solo_host_part(cm: CostModel, capacity: int, idle: float, host_state: bool) -> float:
    """The least part x of the whole state a device of this type must keep on the host to
    hold all of it: its device bytes (1 - x) Bs + x Bd (Bs per fraction on the device, Bd per
    fraction on the host: its compute-dtype copy and reduce-scatter output) fit in what is
    left beside its least working memory `idle` (0 without host state, or where all fits)."""
    Bs, Bd = cm.bytes_per_fraction, cm.host_part_device_bytes_per_fraction
    room = capacity - MEMORY_SLACK_BYTES - idle
    if not host_state or Bs <= Bd or room >= Bs:
        return 0.0
    return min(1.0, (Bs - room) / (Bs - Bd))


def solo_optimizer_s(
    cm: CostModel, type_key: str, host_s_per_param: float | None, host_part: float = 0.0
) -> float:
    """The least optimizer phase (`CostModel.optimizer_phase_s`) of a device of this type that
    holds the whole state (s = 1), x >= `host_part` of it on a host whose AdamW takes at least
    `host_s_per_param` seconds per parameter (None: no host state, x = 0).

    On the device it takes (1 - x) a, a = trained parameters x seconds per parameter; the
    host part x P h (its AdamW) and x P u (the uploads of all P parameters in the compute dtype
    over the host link). With async copies the phase is the max of the three, at least
    max((1 - x) a, x b), b = P max(h, u), least at x = max(a / (a + b), host_part) (where x b
    is the larger); without, their sum, at least (1 - x) a + x b, b = P (h + u), linear in x:
    least at x = host_part or 1."""
    a = cm.optimizer_params * cm.optimizer_s_per_param(type_key)
    if host_s_per_param is None:
        return a
    profile = cm.profiles[type_key]
    up = cm.dtype_bytes / profile.host_copy_bytes_per_s
    if not profile.async_copies:
        b = cm.total_params * (host_s_per_param + up)
        return min((1 - host_part) * a + host_part * b, b)
    b = cm.total_params * max(host_s_per_param, up)
    if a + b <= 0:
        return 0.0
    return max(a * b / (a + b), host_part * b)


def flat_ring(n: int, intra: float, inter: float, nodes: int) -> Ring:
    """The ring of a flat plan of n devices on `nodes` nodes: the slowest link it crosses."""
    if n <= 1:
        return NO_COLLECTIVES
    return Ring(n, min(intra, inter) if nodes > 1 else intra)


def nodes_of(offers: Sequence[Offer], units: Sequence[int]) -> list[tuple[int, int]]:
    """(offer index, GPUs) of each node of the cluster `advise_clusters.cluster_of` builds, in
    its order: an offer's whole nodes of `per_node` GPUs, or one node of all its GPUs."""
    out = []
    for j, (o, k) in enumerate(zip(offers, units, strict=True)):
        if k <= 0:
            continue
        if o.per_node:
            out.extend([(j, o.per_node)] * int(k))
        else:
            out.append((j, int(k) * o.unit_gpus))
    return out


def cover_time(ranks: list[tuple[int, np.ndarray]], batch: int) -> float:
    """The least T >= every table's L(0) at which sum count * max{b : L(b) <= T} >= batch, for
    (count, L) pairs (inf: no T does)."""
    floor = max(float(L[0]) for _, L in ranks)
    cand = np.unique(np.concatenate([L[1:] for _, L in ranks] + [np.array([floor])]))
    cand = cand[np.isfinite(cand) & (cand >= floor)]

    def covers(T: float) -> bool:
        return sum(c * int(np.searchsorted(L[1:], T, side="right")) for c, L in ranks) >= batch

    if cand.size == 0 or not covers(float(cand[-1])):
        return math.inf
    lo, hi = 0, cand.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if covers(float(cand[mid])):
            hi = mid
        else:
            lo = mid + 1
    return float(cand[lo])


class BoundTables:
    """The tables L(b) of every offer's type under every ring the search asks about, cached,
    and the bounds built from them (see the module docstring)."""

    def __init__(
        self,
        base: CostModel,
        profiles: dict,
        types: dict[str, TypeBound],
        offers: Sequence[Offer],
        global_batch: int,
        latency_s: float,
        hierarchy: bool,
        reduce_dtype: str,
        host_state: bool,
    ):
        self.base = base
        self.profiles = profiles
        self.types = types
        self.offers = list(offers)
        self.global_batch = global_batch
        self.latency_s = latency_s
        self.hierarchy = hierarchy
        self.reduce_dtype = reduce_dtype
        self.host_state = host_state and not base.adapter.frozen_base
        """Whether the planner may keep state on the host (`--no-host-state`; not for a frozen
        base)."""
        self.state_cap = np.array([types[o.type].state_cap for o in self.offers])
        self.max_intra = max(o.intra_bytes_per_s for o in self.offers)
        self.max_inter = max(o.inter_node_bytes_per_s for o in self.offers)
        self._comm_models: dict[Ring, CostModel] = {}
        # bound tables are B + 1 floats each: keep about 64 MiB of them
        row_bytes = 8 * (global_batch + 1)
        self.table: Callable[[str, Ring], np.ndarray] = lru_cache(
            maxsize=max(64, min(8192, TABLE_CACHE_BYTES // row_bytes))
        )(self._table)
        self._count_T: float | None = None
        self._count_memo: dict[tuple[str, Ring], int] = {}
        self._flat_memo: dict[Ring, tuple[np.ndarray, float]] = {}
        self._offer_memo: dict[CountKey, tuple[int, int, int, float, float]] = {}
        self._offer_index = range(len(self.offers))
        self._offer_intra = [o.intra_bytes_per_s for o in self.offers]
        self._offer_inter = [o.inter_node_bytes_per_s for o in self.offers]
        self._rings_memo: dict[OfferKey, OfferRings] = {}
        self._last_group: tuple[NodeBounds, tuple[float, float], tuple] | None = None

    # ------------------------------------------------------------------ tables
    def _comm_model(self, ring: Ring) -> CostModel:
        cm = self._comm_models.get(ring)
        if cm is None:
            base = self.base
            comm = CommProfile(
                bytes_per_s=ring.link if ring.n > 1 else 1.0, latency_s=self.latency_s
            )
            cross = (
                CrossReduce(ring.groups, self.reduce_dtype, ring.cross, self.latency_s)
                if ring.groups > 1
                else None
            )
            cm = CostModel(
                base.model,
                base.seq_len,
                base.dtype,
                base.devices[:1] * ring.n,
                self.profiles,
                comm,
                reserve_bytes=base.reserve_bytes,
                reserve_fraction=base.reserve_fraction,
                reserve_extra_bytes=base.reserve_extra_bytes,
                adapter=base.adapter,
                cross_reduce=cross,
            )
            self._comm_models[ring] = cm
        return cm

    def _table(self, type_key: str, ring: Ring) -> np.ndarray:
        """L(b) for b = 0..B: a lower bound on a rank's step time at b samples (no optimizer,
        but for a `solo` rank: its whole state's least optimizer phase, and its micro-batches
        only as large as fit beside that state)."""
        t = self.types[type_key]
        cm = self._comm_model(ring._replace(solo=None))
        bs = np.arange(self.global_batch + 1)
        passes, mmax, x = t.passes, t.max_micro_batch, 0.0
        if ring.solo is not None and t.solo is not None:
            # a solo rank's host part is at least solo.host_part: its gradient copies add time
            passes, mmax, x = t.solo.passes, t.solo.max_micro_batch, t.solo.host_part
        L = np.array(
            cm.step_time_of_passes(type_key, bs, passes, False, True, x)[0], dtype=np.float64
        )
        if ring.solo is not None:
            L += ring.solo
        if mmax == 0:
            L[1:] = np.inf  # not even one sample fits: this device only holds state
        return L

    def _offer_rings(self, key: OfferKey) -> OfferRings:
        """The rings of one offer's rank in the shard groups of a completion (see the module
        docstring): `key` = (offer, a, x, s, g, g_last), a and x the most intra- and inter-node
        rates its completions may have (at most the offer's own), s, g and g_last its
        `NodeBounds` sizes, groups and last_groups. A rank's group is its node alone (at least
        g groups, over the intra-node link: a node of one device holds the whole state, a
        `solo` ring, where it can; a node of an offer whose count is open, s = 0, has one
        device or at least 2) or spans at least one more node's device (2 groups at least,
        over the slower of both links); as the cluster's last node, alone among g_last groups.
        Kept for the whole search: the key is a few scalars, the rings do not depend on T."""
        hit = self._rings_memo.get(key)
        if hit is not None:
            return hit
        j, a, x, s, g, g_last = key
        o = self.offers[j]
        span = Ring(max(s, 1) + 1, min(a, x), 2, x)
        alone: list[Ring] = []
        for groups in (g, g_last):
            if s > 1:
                alone.append(Ring(s, a, groups, x))
            elif self.types[o.type].state_cap >= 1 - STATE_SLACK:
                alone.append(Ring(1, 0.0, groups, x, self._solo_optimizer_s(o.type)))
            else:  # one device cannot hold a replica: never a group alone
                alone.append(span)
        # an open count: a node of >= 2 devices on the intra-node link, too (its samples are at
        # most the most either allows); a fixed one has just the one ring, counted once
        mid = (alone[0], Ring(2, a, g, x)) if s == 0 else (alone[0],)
        last = (alone[1], Ring(2, a, g_last, x)) if s == 0 else (alone[1],)
        table = self.table
        g_floor = min(float(table(o.type, r)[0]) for r in (span, *mid))
        last_floor = min(float(table(o.type, r)[0]) for r in last)
        hit = self._rings_memo[key] = OfferRings(o.type, span, mid, last, g_floor, last_floor)
        return hit

    # ------------------------------------------------------------------ partial clusters
    def betas(
        self,
        ring: Ring,
        T: float,
        links: tuple[float, float] | None,
        nb: NodeBounds | None = None,
    ) -> tuple[list[Cover], float]:
        """The covers of a partial's completions within step time T (one per kind of plan, a
        completion's samples within the most any of them allows) and the least L(0) of their
        tables. Each gives per offer the most samples one of its GPUs takes in a flat plan on
        `ring` or (`links` = the most intra- and inter-node rates a completion may have, `nb`
        what its nodes have: with shard groups) in a shard group, and `extra` samples one node
        may add (module docstring).

        Its parts are cached for the last T (the search asks for one T until its best
        throughput rises), per flat ring and per offer's group rings (`_offer_rings`' small
        keys): partials seldom share all their offers' node bounds at once, while each offer's
        few (links, size, groups) recur across them."""
        if self._count_T != T:
            self._count_T, self._count_memo, self._flat_memo, self._offer_memo = T, {}, {}, {}
            self._last_group = None
        flat = self._flat_memo.get(ring)
        if flat is None:
            flat = self._flat_memo[ring] = (
                self._count((ring,) * len(self.offers), T),
                float(self.table(self.offers[0].type, ring)[0]),
            )
        betas, floor = flat
        if not self.hierarchy or links is None or nb is None:
            return [Cover(betas, 0)], floor
        # `Advisor._completion_cost` asks again with the same `nb` and links at more devices:
        # the group part does not depend on the flat ring, so the last one is kept
        last_group = self._last_group
        if last_group is not None and last_group[0] is nb and last_group[1] == links:
            group = last_group[2]
        else:
            group = self._group_part(links, nb, T)
            self._last_group = (nb, links, group)
        grouped, g_floor, spans, extra = group
        betas = np.maximum(betas, grouped)
        floor = min(floor, g_floor)
        if spans is None:
            return [Cover(betas, 0)], floor
        return [Cover(betas, 0), Cover(spans, extra)], floor

    def _group_part(
        self, links: tuple[float, float], nb: NodeBounds, T: float
    ) -> tuple[np.ndarray, float, np.ndarray | None, int]:
        """`betas`' shard-group part: per offer the most one GPU takes in a group other than the
        last node alone, the least L(0) of all groups (the last node's too); and where some
        offer's node may be the cluster's last, the betas of a rank spanning nodes and what that
        node may take beyond them (else None, 0)."""
        intra = min(links[0], self.max_intra)
        inter = min(links[1], self.max_inter)
        memo = self._offer_memo
        hits = []
        for j, o_intra, o_inter, s, g, g_last, last in zip(
            self._offer_index,
            self._offer_intra,
            self._offer_inter,
            nb.sizes,
            nb.groups,
            nb.last_groups,
            nb.last,
            strict=True,
        ):
            # a completion holding this offer has no link faster than the offer's own (as
            # min(intra, o_intra), without its call: this loop runs millions of times)
            a = o_intra if o_intra < intra else intra
            x = o_inter if o_inter < inter else inter
            key = (j, a, x, s, g, g_last, last)
            hit = memo.get(key)
            if hit is None:
                hit = memo[key] = self._offer_counts(key, T)
            hits.append(hit)
        grouped, spans, gains, g_floors, last_floors = zip(*hits, strict=True)
        # an offer whose node cannot be last has an infinite last floor: left out of the min
        g_floor = min(min(g_floors), min(last_floors))
        grouped_betas = np.array(grouped, dtype=np.int64)
        if not any(nb.last):
            return grouped_betas, g_floor, None, 0
        # only one node is the cluster's last: what one GPU of it may take beyond the spanning
        # rings' samples, once, for the offer that gains most
        return grouped_betas, g_floor, np.array(spans, dtype=np.int64), int(max(gains))

    def _offer_counts(self, key: CountKey, T: float) -> tuple[int, int, int, float, float]:
        """For one offer within T (`key`: `_offer_rings`' key and `last`, the most devices its
        node has as the cluster's last, 0: it cannot be): the most samples one GPU takes in a
        group other than the last node alone, in a group spanning nodes, what its node may take
        beyond that as the last node alone, and the least L(0) of both kinds (inf for the last
        node's where it cannot be last)."""
        r = self._offer_rings(key[:6])
        span = self._count_one(r.type, r.span, T)
        grouped = max(span, *(self._count_one(r.type, ring, T) for ring in r.alone))
        last = key[6]
        if not last:
            return grouped, span, 0, r.g_floor, math.inf
        most = max(self._count_one(r.type, ring, T) for ring in r.last)
        return grouped, span, max(most - span, 0) * last, r.g_floor, r.last_floor

    def _count_one(self, type_key: str, ring: Ring, T: float) -> int:
        """The most samples (b >= 1) the table of this type under `ring` allows within T (the
        caller resets the memo when T changes)."""
        c = self._count_memo.get((type_key, ring))
        if c is None:
            row = self.table(type_key, ring)[1:]
            c = self._count_memo[(type_key, ring)] = int(np.searchsorted(row, T, side="right"))
        return c

    def _count(self, rings: tuple[Ring, ...], T: float) -> np.ndarray:
        """Per offer: the most samples (b >= 1) its table under rings[j] allows within T."""
        return np.array(
            [self._count_one(o.type, r, T) for o, r in zip(self.offers, rings, strict=True)],
            dtype=np.int64,
        )

    # ------------------------------------------------------------------ complete clusters
    def plan_shapes(self, units: Sequence[int], intra: float, inter: float) -> list[Shape]:
        """The plans the planner may make of the cluster of `units`: per plan, per group,
        (type, GPUs, ring) of its ranks; the flat plan first, then each candidate grouping
        (`groups.candidate_groupings` on `advise_clusters.cluster_of`'s nodes: one group per
        node, then per 2, 4, ... consecutive nodes) whose groups can each hold a replica."""
        nodes = [(self.offers[j].type, g) for j, g in nodes_of(self.offers, units)]
        n = sum(g for _, g in nodes)
        flat = flat_ring(n, intra, inter, len(nodes))
        if n == 1:  # one device: it holds the whole state
            flat = flat._replace(solo=self._solo_optimizer_s(nodes[0][0]))
        shapes: list[Shape] = [[[(t, g, flat) for t, g in nodes]]]
        if not self.hierarchy or len(nodes) < 2:
            return shapes
        k = 1
        while k < len(nodes):
            chunks = [nodes[i : i + k] for i in range(0, len(nodes), k)]
            plan = []
            for chunk in chunks:
                size = sum(g for _, g in chunk)
                link = intra if len(chunk) == 1 else min(intra, inter)
                ring = (
                    Ring(size, link, len(chunks), inter)
                    if size > 1
                    else Ring(1, 0.0, len(chunks), inter, self._solo_optimizer_s(chunk[0][0]))
                )
                plan.append([(t, g, ring) for t, g in chunk])
            if all(self._holds_replica(group) for group in plan):
                shapes.append(plan)
            k *= 2
        return shapes

    def grouping_floor(self, cm: CostModel, groups: list[list[int]]) -> float:
        """A lower bound on the step of any plan of the cluster of `cm` in these shard groups
        (inf: a group cannot hold a replica; 0 where the cluster has devices or links the
        tables do not describe: another type or memory, another collective latency)."""
        links = cm.links
        if links is None or links.latency_s < self.latency_s or len(groups) < 2:
            return 0.0
        plan = []
        for members in groups:
            group: dict[tuple[str, Ring], int] = {}
            ring = Ring(
                len(members), links.bytes_per_s(members), len(groups), links.inter_bytes_per_s
            )
            for r in members:
                d = cm.devices[r]
                t = self.types.get(d.type_key)
                if t is None or int(d.memory_bytes) != t.capacity:
                    return 0.0
                if len(members) == 1:  # alone: the whole state, its host's AdamW speed
                    host = cm.host.optimizer_s_per_param[r] if cm.host is not None else None
                    part = t.solo.host_part if t.solo is not None else 0.0
                    solo = solo_optimizer_s(cm, d.type_key, host if self.host_state else None, part)
                    ring = Ring(1, 0.0, len(groups), links.inter_bytes_per_s, solo)
                group[(d.type_key, ring)] = group.get((d.type_key, ring), 0) + 1
            plan.append([(t, g, ring) for (t, ring), g in group.items()])
        if not all(self._holds_replica(group) for group in plan):
            return math.inf
        return self._plan_time(plan)

    def _solo_optimizer_s(self, type_key: str) -> float:
        solo = self.types[type_key].solo
        return solo.optimizer_s if solo is not None else 0.0

    def _holds_replica(self, group: Group) -> bool:
        return sum(g * self.types[t].state_cap for t, g, _ in group) >= 1 - STATE_SLACK

    def _plan_ranks(self, plan: Shape) -> list[tuple[int, np.ndarray]]:
        """(GPUs, table) of a plan's ranks, one pair per type and ring."""
        ranks: dict[tuple[str, Ring], int] = {}
        for group in plan:
            for t, g, ring in group:
                ranks[(t, ring)] = ranks.get((t, ring), 0) + g
        return [(c, self.table(t, ring)) for (t, ring), c in ranks.items()]

    def _plan_time(self, plan: Shape) -> float:
        """The least step of a plan of this shape (`cover_time`; in shard groups, also the
        least at which every group takes a sample)."""
        t = cover_time(self._plan_ranks(plan), self.global_batch)
        if len(plan) > 1:
            t = max(t, max(self._one_sample(group) for group in plan))
        return t

    def step_lower_bound(self, units: Sequence[int], intra: float, inter: float) -> float:
        """The least step time any plan of the cluster can have (inf: none fits; the caller
        checks the cluster's total state capacity)."""
        return min(self._plan_time(plan) for plan in self.plan_shapes(units, intra, inter))

    def reaches(self, units: Sequence[int], intra: float, inter: float, T: float) -> bool:
        """Whether some plan of the cluster may step within T (`step_lower_bound` <= T, without
        its search)."""
        for plan in self.plan_shapes(units, intra, inter):
            ranks = self._plan_ranks(plan)
            if max(float(L[0]) for _, L in ranks) > T:
                continue
            if len(plan) > 1 and max(self._one_sample(group) for group in plan) > T:
                continue
            held = sum(c * int(np.searchsorted(L[1:], T, side="right")) for c, L in ranks)
            if held >= self.global_batch:
                return True
        return False

    def _one_sample(self, group: Group) -> float:
        """The least step at which some rank of the group takes a sample."""
        return min(float(self.table(t, ring)[1]) for t, _, ring in group)
