"""Hierarchical uneven sharding: which shard groups to form, chosen by the planner.

A *grouping* splits the ranks into shard groups of whole nodes: the whole cluster (today's
flat plan), one group per node, or groups of k consecutive nodes. Every group holds a whole
replica of the training state, sharded unevenly over its ranks (all-gathers and
reduce-scatters stay inside the group, over its own links); once per step the ranks that own
the same bytes in different groups all-reduce their gradient shards over the inter-node
network (`CostModel.group_model`, `CrossReduce`: one formula, in the cost model).

For one grouping, each group g is planned by the flat planner on its own cost model; T_g(b),
the optimal step of group g with b samples, is non-decreasing in b. The grouping's optimum is
then min over splits sum_g b_g = B (b_g >= 1) of max_g T_g(b_g): the smallest T with
sum_g maxB_g(T) >= B, where maxB_g(T) = the largest b with T_g(b) <= T. It is found by
bisection on T with, per distinct kind of group (same devices in the same order, same hosts),
a bracket [maxB(T_lo), maxB(T_hi)] that only narrows, and T_g(b) memoised; once every bracket
is one sample wide the optimum is the least known T_g(b) at which the counts reach B. So the
split is exact given the flat planner's per-group optima (`tests/test_hierarchy_planner.py`
compares it with every split).

The candidates: the flat plan always (so a hierarchical plan is only returned where it is
predicted faster), one group per node, and groups of k = 2, 4, 8, ... consecutive nodes, the
latter only while the smaller groupings cannot hold a replica in some group (under the ring
model a group spanning nodes runs its collectives at the inter-node rate like the flat ring,
so it only pays where memory forces it).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from cephalo.errors import CephaloError, PlanDoesNotFit
from cephalo.log import logger
from cephalo.planning.costmodel import CostModel
from cephalo.planning.plan import REDUCE_DTYPES, Plan, RankPlan, ShardGroup

BISECT_REL_TOL = 1e-7
"""Relative width at which the bisection on T stops even if some bracket is still open."""


@dataclass
class Grouping:
    """One candidate: the ranks of each shard group (node-aligned)."""

    label: str
    """`flat`, `per node`, `2 nodes`, ..."""
    groups: list[list[int]]


@dataclass
class GroupingResult:
    grouping: Grouping
    plan: Plan | None
    step_s: float
    reason: str = ""
    """Why there is no plan (a group that cannot hold a replica)."""


@dataclass
class _Kind:
    """Groups with the same devices and hosts: one memo of T(b) serves them all."""

    cm: CostModel
    count: int
    members: list[list[int]] = field(default_factory=list)
    memo: dict[int, tuple[float, Plan | None]] = field(default_factory=dict)
    lo: int = 0
    """maxB(T_lo): T(b) <= T_lo for b <= lo (0: not even one sample)."""
    hi: int = 0
    """maxB(T_hi)."""


def node_groups(cm: CostModel) -> list[list[int]]:
    """The ranks of each node, nodes in order of first appearance."""
    node_of = cm.links.node_of if cm.links is not None else (0,) * len(cm.devices)
    nodes: dict[int, list[int]] = {}
    for r, n in enumerate(node_of):
        nodes.setdefault(n, []).append(r)
    return list(nodes.values())


def candidate_groupings(cm: CostModel) -> list[Grouping]:
    """Per node, then groups of 2, 4, ... consecutive nodes (fewer than all); flat excluded."""
    nodes = node_groups(cm)
    out = []
    k = 1
    while k < len(nodes):
        groups = [sum(nodes[i : i + k], []) for i in range(0, len(nodes), k)]
        out.append(Grouping("per node" if k == 1 else f"{k} nodes", [sorted(g) for g in groups]))
        k *= 2
    return out


def make_hierarchical_plan(
    cm: CostModel,
    global_batch: int,
    hierarchy: bool = True,
    reduce_dtype: str = "fp32",
    groupings: list[Grouping] | None = None,
    **planner_kw,
) -> Plan:
    """The best plan over the flat one and the candidate groupings (`hierarchy=False`: the flat
    plan only). `planner_kw` goes to `planner.make_plan` (offload, host state, model name).

    The returned plan's `meta["groupings"]` lists each candidate's predicted step."""
    from cephalo.planning.planner import make_plan

    if reduce_dtype not in REDUCE_DTYPES:
        raise CephaloError(
            f"cross-node reduce dtype {reduce_dtype!r} is not one of {', '.join(REDUCE_DTYPES)}"
        )
    started = time.perf_counter()
    flat_error: PlanDoesNotFit | None = None
    try:
        flat = make_plan(cm, global_batch, **planner_kw)
        best: Plan | None = flat
        best_step = flat.predicted.step_s
    except PlanDoesNotFit as e:
        if not hierarchy:
            raise
        flat_error, best, best_step = e, None, math.inf
    summary = [{"grouping": "flat", "step_s": best_step if flat_error is None else None}]
    if hierarchy and len(node_groups(cm)) > 1:
        candidates = groupings if groupings is not None else candidate_groupings(cm)
        replica_missing = False
        for grouping in candidates:
            if groupings is None and grouping.label != "per node" and not replica_missing:
                break  # groups of several nodes only where smaller ones cannot hold a replica
            res = plan_grouping(cm, global_batch, grouping, reduce_dtype, **planner_kw)
            summary.append(
                {
                    "grouping": grouping.label,
                    "step_s": res.step_s if res.plan is not None else None,
                    **({"reason": res.reason} if res.reason else {}),
                }
            )
            replica_missing = res.plan is None
            if res.plan is not None and res.step_s < best_step:
                best, best_step = res.plan, res.step_s
    if best is None:
        assert flat_error is not None
        raise flat_error
    best.meta["groupings"] = summary
    best.meta["planner_wall_s"] = round(time.perf_counter() - started, 6)
    return best


def plan_grouping(
    cm: CostModel, global_batch: int, grouping: Grouping, reduce_dtype: str = "fp32", **planner_kw
) -> GroupingResult:
    """The optimal plan under one grouping (see the module docstring), or why there is none."""
    from cephalo.planning.planner import make_plan

    g = len(grouping.groups)
    if g == 1:
        try:
            p = make_plan(cm, global_batch, **planner_kw)
        except PlanDoesNotFit as e:
            return GroupingResult(grouping, None, math.inf, str(e).splitlines()[0])
        return GroupingResult(grouping, p, p.predicted.step_s)
    if global_batch < g:
        return GroupingResult(grouping, None, math.inf, f"global batch {global_batch} < {g} groups")
    kinds: dict[tuple, _Kind] = {}
    for members in grouping.groups:
        key = _kind_key(cm, members)
        if key not in kinds:
            kinds[key] = _Kind(cm.group_model(members, g, reduce_dtype), 0)
        kinds[key].count += 1
        kinds[key].members.append(members)
    ks = list(kinds.values())
    bmax = global_batch - (g - 1)

    def T(kind: _Kind, b: int) -> float:
        if b not in kind.memo:
            try:
                p = make_plan(kind.cm, b, **planner_kw)
                kind.memo[b] = (p.predicted.step_s, p)
            except PlanDoesNotFit as e:
                kind.memo[b] = (math.inf, None)
                kind.memo.setdefault(-1, (math.inf, e))  # type: ignore[arg-type]
        return kind.memo[b][0]

    for k in ks:
        if not math.isfinite(T(k, 1)):
            err = k.memo.get(-1, (0, None))[1]
            first = str(err).splitlines()[0] if err is not None else "does not fit"
            return GroupingResult(
                grouping,
                None,
                math.inf,
                f"ranks {k.members[0]} cannot hold a replica: {first}",
            )

    def max_b(kind: _Kind, t: float) -> int:
        """Largest b in [kind.lo, kind.hi] with T(b) <= t (kind.lo when none above it)."""
        lo, hi = kind.lo, kind.hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if T(kind, mid) <= t:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # brackets from a speed-proportional split: rounded down, the kinds' steps bound the
    # optimum from below (the counts fall short of B below the least of them); rounded up, they
    # reach B within the largest of them
    probe = min(bmax, max(1, global_batch // g))
    rates = [probe / T(k, probe) for k in ks]
    if not all(math.isfinite(r) and r > 0 for r in rates):
        rates = [1.0 for _ in ks]
    total_rate = sum(r * k.count for r, k in zip(rates, ks, strict=True))
    shares = [global_batch * r / total_rate for r in rates]
    ups = [min(bmax, max(1, math.ceil(x))) for x in shares]
    downs = [min(bmax, max(1, math.floor(x))) for x in shares]
    t_hi = max(T(k, b) for k, b in zip(ks, ups, strict=True))
    if not math.isfinite(t_hi):
        t_hi = max(T(k, bmax) for k in ks)
        if not math.isfinite(t_hi):
            return GroupingResult(grouping, None, math.inf, "no split of the batch fits")
    t_lo = max(T(k, 1) for k in ks)
    if sum(k.count * b for k, b in zip(ks, downs, strict=True)) <= global_batch:
        t_lo = max(t_lo, min(T(k, b) for k, b in zip(ks, downs, strict=True)))
    t_lo *= 1 - 1e-12
    for k in ks:
        k.lo, k.hi = 0, bmax
        k.hi = max_b(k, t_hi)
        k.lo = max_b(_Kind(k.cm, k.count, memo=k.memo, lo=0, hi=k.hi), t_lo)

    def count(t: float) -> int:
        return sum(k.count * max_b(k, t) for k in ks)

    while any(k.hi - k.lo > 1 for k in ks) and t_hi - t_lo > BISECT_REL_TOL * t_hi:
        mid = 0.5 * (t_lo + t_hi)
        saved = [(k.lo, k.hi) for k in ks]
        bs = [max_b(k, mid) for k in ks]
        if sum(k.count * b for k, b in zip(ks, bs, strict=True)) >= global_batch and min(bs) >= 1:
            t_hi = mid
            for k, b, (lo, _) in zip(ks, bs, saved, strict=True):
                k.lo, k.hi = lo, b
        else:
            t_lo = mid
            for k, b, (_, hi) in zip(ks, bs, saved, strict=True):
                k.lo, k.hi = b, hi
    # the optimum is the least known T(b) in (t_lo, t_hi] at which the counts reach B
    values = sorted({T(k, b) for k in ks for b in range(max(1, k.lo), k.hi + 1)} | {t_hi})
    t_star = t_hi
    for v in values:
        if t_lo < v <= t_hi and count(v) >= global_batch and all(max_b(k, v) >= 1 for k in ks):
            t_star = v
            break
    # per group: its kind's maxB(t_star), trimmed to B (trimming only shortens a group's step)
    per_group: list[int] = []
    order = []
    for k in ks:
        b = max_b(k, t_star)
        per_group.extend([b] * k.count)
        order.extend(k.members)
    excess = sum(per_group) - global_batch
    while excess > 0:  # take samples back from the group with the most (each keeps >= 1)
        j = max(range(len(per_group)), key=lambda x: (per_group[x], -x))
        per_group[j] -= 1
        excess -= 1
    batch_of = {tuple(m): b for m, b in zip(order, per_group, strict=True)}
    plan = _assemble(cm, global_batch, grouping, kinds, batch_of, T, reduce_dtype)
    step = plan.predicted.step_s
    logger.debug("grouping %s: step %.4g s, batches %s", grouping.label, step, per_group)
    return GroupingResult(grouping, plan, step)


def _kind_key(cm: CostModel, members: list[int]) -> tuple:
    devs = tuple((cm.devices[r].type_key, int(cm.devices[r].memory_bytes)) for r in members)
    host = None
    if cm.host is not None:
        host = (
            tuple(cm.host.optimizer_s_per_param[r] for r in members),
            tuple(cm.host.memory_bytes[cm.host.node_of[r]] for r in members),
            len({cm.host.node_of[r] for r in members}),
        )
    links = None if cm.links is None else cm.links.bytes_per_s(members)
    return devs, host, links


def _assemble(cm, B, grouping, kinds, batch_of, T, reduce_dtype) -> Plan:
    ranks: list[RankPlan | None] = [None] * len(cm.devices)
    kind_of = {tuple(m): k for k in kinds.values() for m in k.members}
    for members in grouping.groups:
        kind = kind_of[tuple(members)]
        b = batch_of[tuple(members)]
        T(kind, b)
        sub = kind.memo[b][1]
        assert sub is not None
        for local, r in zip(sub.ranks, members, strict=True):
            ranks[r] = RankPlan(**{**local.__dict__, "rank": r})
    first = next(iter(kinds.values())).memo
    sub_meta = next(p for _, p in first.values() if isinstance(p, Plan)).meta
    meta = {k: v for k, v in sub_meta.items() if k not in ("planner_wall_s",)}
    meta.update(cm.meta)
    plan = Plan(
        strategy="cephalo",
        model=next(p for _, p in first.values() if isinstance(p, Plan)).model,
        seq_len=cm.seq_len,
        global_batch_size=B,
        dtype=cm.dtype,
        ranks=ranks,  # type: ignore[arg-type]
        shard_groups=[ShardGroup(ranks=list(m)) for m in grouping.groups],
        cross_group_reduce_dtype=reduce_dtype,
        meta=meta,
    )
    plan.meta["grouping"] = grouping.label
    plan.validate()
    from cephalo.planning.planner import fill_predictions

    fill_predictions(cm, plan)
    return plan


def grouping_lines(plan: Plan) -> list[str]:
    """For `cephalo plan`: the shard groups of the plan and each candidate grouping's step."""
    lines = []
    if plan.hierarchical:
        groups = "  ".join(
            f"{i}: ranks {g[0]}-{g[-1]}" if g == list(range(g[0], g[-1] + 1)) else f"{i}: ranks {g}"
            for i, g in enumerate(plan.groups)
        )
        lines.append(
            f"shard groups ({plan.meta.get('grouping', 'custom')}): {groups}; gradients all-reduced "
            f"between them once per step in {plan.cross_group_reduce_dtype}"
        )
    tried = plan.meta.get("groupings") or []
    if len(tried) > 1:
        parts = []
        for t in tried:
            step = t.get("step_s")
            parts.append(
                f"{t['grouping']} {step:.4g} s"
                if step is not None
                else f"{t['grouping']} does not fit"
            )
        lines.append("groupings (predicted step): " + ", ".join(parts))
    return lines
