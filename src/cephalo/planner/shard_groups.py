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
sum_g maxB_g(T) >= B, where maxB_g(T) = the largest b with T_g(b) <= T. Groups of one kind
(the same devices in the same order, hosts and links: `CostModel.group_key`) share one memoised curve
T(b), so identical nodes are planned once per batch size however many there are, and
`group_split.split_batch` finds the optimum with a few points of each curve. So the split is
exact given the flat planner's per-group optima (`tests/test_hierarchy_planner.py` compares it
with every split).

The candidates: the flat plan always (so a hierarchical plan is only returned where it is
predicted faster), one group per node, and groups of k = 2, 4, 8, ... consecutive nodes, the
latter only while the smaller groupings cannot hold a replica in some group (under the ring
model a group spanning nodes runs its collectives at the inter-node rate like the flat ring,
so it only pays where memory forces it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cephalo.costmodel.model import CostModel
from cephalo.errors import CephaloError, PlanDoesNotFit
from cephalo.log import logger
from cephalo.planner.group_split import GroupPlanMemo, StepCurve, split_batch
from cephalo.planner.plan import REDUCE_DTYPES, Plan, RankPlan, ShardGroup


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
    plans_made: int = 0
    """Plans of single groups made to find it (one curve per kind of group)."""


@dataclass
class _Kind:
    """The groups of one kind (`CostModel.group_key`): one step curve serves them all."""

    curve: StepCurve
    members: list[list[int]] = field(default_factory=list)


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
    step_floor: Callable[[Grouping], float] | None = None,
    memo: GroupPlanMemo | None = None,
    **planner_kw,
) -> Plan:
    """The best plan over the flat one and the candidate groupings (`hierarchy=False`: the flat
    plan only). `planner_kw` goes to `planner.make_plan` (offload, host state, model name).

    The returned plan's `meta["groupings"]` lists each candidate's predicted step. A grouping
    whose all-reduce between groups alone (`CostModel.cross_reduce_total_s`, a floor under
    every rank's step) takes at least the best step found is not planned (`at_least_s`).

    `step_floor(grouping)`, where given, is a lower bound on the step of every plan of the
    grouping (the advisor's, `advise_bound.BoundTables.grouping_floor`): once no candidate left
    has a floor below the best step found, none of them is planned. Only then, so the candidates
    planned before are those planned without it, and the plan returned is the same.

    `memo`: the plans of shard groups made before, to share with other calls (the advisor
    plans many clusters whose groupings repeat groups); None: one for this call's groupings.
    Either way every plan is the one planned afresh (`group_split.GroupPlanMemo`)."""
    from cephalo.planner.makers import make_plan

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
        memo = memo if memo is not None else GroupPlanMemo()
        candidates = groupings if groupings is not None else candidate_groupings(cm)
        # the least floor of each candidate and those after it: a grouping that cannot win
        # is still planned while a later one could, as whether the later ones are tried
        # depends on its plan (below)
        floors = [step_floor(c) for c in candidates] if step_floor is not None else []
        rest = [min(floors[i:]) for i in range(len(floors))]
        replica_missing = False
        for i, grouping in enumerate(candidates):
            if groupings is None and grouping.label != "per node" and not replica_missing:
                break  # groups of several nodes only where smaller ones cannot hold a replica
            if rest and rest[i] >= best_step:
                summary.extend(
                    {"grouping": c.label, "step_s": None, "at_least_s": f}
                    for c, f in zip(candidates[i:], floors[i:], strict=True)
                )
                break  # no candidate left can beat the best plan
            g = len(grouping.groups)
            floor = cm.group_model(grouping.groups[0], g, reduce_dtype).cross_reduce_total_s
            if floor >= best_step:  # its all-reduce alone is no faster than the best plan's step
                summary.append({"grouping": grouping.label, "step_s": None, "at_least_s": floor})
                replica_missing = False
                continue
            res = plan_grouping(cm, global_batch, grouping, reduce_dtype, memo, **planner_kw)
            summary.append(
                {
                    "grouping": grouping.label,
                    "step_s": res.step_s if res.plan is not None else None,
                    "plans": res.plans_made,
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
    cm: CostModel,
    global_batch: int,
    grouping: Grouping,
    reduce_dtype: str = "fp32",
    memo: GroupPlanMemo | None = None,
    **planner_kw,
) -> GroupingResult:
    """The optimal plan under one grouping (see the module docstring), or why there is none.
    `memo`: group plans made before (`make_hierarchical_plan`)."""
    from cephalo.planner.makers import make_plan

    g = len(grouping.groups)
    if g == 1:
        try:
            p = make_plan(cm, global_batch, **planner_kw)
        except PlanDoesNotFit as e:
            return GroupingResult(grouping, None, math.inf, str(e).splitlines()[0])
        return GroupingResult(grouping, p, p.predicted.step_s)
    if global_batch < g:
        return GroupingResult(grouping, None, math.inf, f"global batch {global_batch} < {g} groups")
    bmax = global_batch - (g - 1)
    kinds: dict[tuple, _Kind] = {}
    for members in grouping.groups:
        key = cm.group_key(members)
        if key not in kinds:
            sub = cm.group_model(members, g, reduce_dtype)
            kinds[key] = _Kind(StepCurve(sub, bmax, planner_kw, memo=memo))
        kinds[key].members.append(members)
    ks = list(kinds.values())
    t_star, best = split_batch([k.curve for k in ks], [len(k.members) for k in ks], global_batch)
    if not math.isfinite(t_star):
        for k in ks:
            if not math.isfinite(k.curve(1)):
                try:  # why (the curve's plans skip the explanation)
                    make_plan(k.curve.cm, 1, **planner_kw)
                    first = "does not fit"
                except PlanDoesNotFit as e:
                    first = str(e).splitlines()[0]
                return GroupingResult(
                    grouping,
                    None,
                    math.inf,
                    f"ranks {k.members[0]} cannot hold a replica: {first}",
                )
        return GroupingResult(grouping, None, math.inf, "no split of the batch fits")
    # per group: its kind's maxB(T*), trimmed to B (trimming only shortens a group's step)
    per_group: list[int] = []
    order = []
    for k, b in zip(ks, best, strict=True):
        per_group.extend([b] * len(k.members))
        order.extend(k.members)
    excess = sum(per_group) - global_batch
    while excess > 0:  # take samples back from the group with the most (each keeps >= 1)
        j = max(range(len(per_group)), key=lambda x: (per_group[x], -x))
        per_group[j] -= 1
        excess -= 1
    batch_of = {tuple(m): b for m, b in zip(order, per_group, strict=True)}
    plan = _assemble(cm, global_batch, grouping, ks, batch_of, reduce_dtype)
    step = plan.predicted.step_s
    logger.debug(
        "grouping %s: step %.4g s, batches %s, %d plans of %d kinds of group",
        grouping.label,
        step,
        per_group,
        sum(k.curve.evaluations for k in ks),
        len(ks),
    )
    return GroupingResult(grouping, plan, step, plans_made=sum(k.curve.evaluations for k in ks))


def _assemble(cm, B, grouping, kinds: list[_Kind], batch_of, reduce_dtype) -> Plan:
    ranks: list[RankPlan | None] = [None] * len(cm.devices)
    kind_of = {tuple(m): k for k in kinds for m in k.members}
    sub_plans = []
    for members in grouping.groups:
        sub = kind_of[tuple(members)].curve.plan(batch_of[tuple(members)])
        sub_plans.append(sub)
        for local, r in zip(sub.ranks, members, strict=True):
            ranks[r] = RankPlan(**{**local.__dict__, "rank": r})
    # the cluster's meta alone: a group's plan carries its group model's, which is the
    # cluster's (and its planner_wall_s), but one from a `GroupPlanMemo` may be another cluster's
    meta = dict(cm.meta)
    plan = Plan(
        strategy="cephalo",
        model=sub_plans[0].model,
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
    from cephalo.planner.choice import fill_predictions

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
            if step is not None:
                parts.append(f"{t['grouping']} {step:.4g} s")
            elif "at_least_s" in t:  # not planned: its all-reduce alone takes this long
                parts.append(f"{t['grouping']} >= {t['at_least_s']:.4g} s")
            else:
                parts.append(f"{t['grouping']} does not fit")
        lines.append("groupings (predicted step): " + ", ".join(parts))
    return lines
