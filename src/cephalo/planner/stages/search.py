"""The planner's choice among flat, shard groups and pipeline stages (issue 40).

`make_staged_plan` plans today's way first (`make_hierarchical_plan`: the flat plan and the
shard groupings), then every staged candidate, and returns the fastest: the flat plan is
always a candidate, so a staged plan is only returned where the cost model predicts it
faster. A staged candidate is

- S stages, 2..min(nodes, MAX_STAGES) (`stages="auto"`) or exactly N (`stages=N`);
- which nodes form each: the nodes in an order (every order of up to 4 nodes; beyond, the
  cluster's order and the nodes by memory, most first), cut into S runs of consecutive nodes (every cut of up to 8 nodes; beyond,
  runs of equal node counts);
- M micro-batches: the divisors of the global batch from S to MICRO_BATCHES_PER_STAGE x S;
- the schedule: 1F1B (in this cost model as fast as GPipe and never holding more boundaries,
  so GPipe is planned only when asked: `schedule="gpipe"`);
- inside each stage, each micro-batch split over its ranks by their speed (`micro_split`: the
  least max block time, greedy over samples, exact for non-decreasing times); its state
  fractions and whether it keeps its weights gathered by the cost model's rules
  (costmodel/stages.py);
- the cut points by the exact DP over units (`cuts.best_cuts`).

Identical stages (the same ranks, split and in-flight count) share one `StageTables`.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass

from cephalo.costmodel.model import CostModel
from cephalo.costmodel.stages import StageTables, in_flight
from cephalo.errors import CephaloError, PlanDoesNotFit
from cephalo.planner.plan import SCHEDULES, Plan, Predicted, RankPlan, Stage
from cephalo.planner.shard_groups import make_hierarchical_plan, node_groups
from cephalo.planner.stages.cuts import best_cuts

MAX_STAGES = 8
"""The most stages `stages="auto"` tries."""
MICRO_BATCHES_PER_STAGE = 16
"""`auto` tries M up to this many micro-batches per stage (bubble (S - 1) / M)."""
ALL_ORDERS_UP_TO = 4
"""Every order of the nodes is tried up to this many nodes."""
ALL_CUTS_UP_TO = 8
"""Every run of consecutive nodes is tried up to this many nodes."""


@dataclass
class StagedCandidate:
    """The best staged plan of one formation, or None."""

    label: str
    step_s: float
    plan: Plan | None


def parse_stages(value: str | int | None) -> str | int:
    """`auto`, `off` or a stage count N >= 1 (1 = off), from the CLI or a config."""
    if value is None:
        return "off"
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        text = str(value).strip().lower()
        if text in ("auto", "off"):
            return text
        try:
            n = int(text)
        except ValueError:
            raise CephaloError(
                f"stages {value!r} is not `auto`, `off` or a number of stages (e.g. 3)"
            ) from None
    if n < 1:
        raise CephaloError(f"stages must be >= 1 (1: no stages), got {n}")
    return "off" if n == 1 else n


def micro_split(cm: CostModel, ranks: list[int], samples: int) -> list[int]:
    """Each rank's samples of one micro-batch of `samples`: the least T at which the ranks'
    block times (forward + recompute + backward, made non-decreasing) take them all, each rank
    as many as it can within T, the last ones trimmed from the ranks with the most (lowest
    first among equals): the least max block time, as the split over shard groups does."""
    import numpy as np

    per_type: dict[str, np.ndarray] = {}
    for r in ranks:
        key = cm.devices[r].type_key
        if key not in per_type:
            b = np.arange(samples + 1)
            f, w = cm._pass_times(key, b, np.maximum(b, 1))["block"]
            per_type[key] = np.maximum.accumulate(np.asarray(f + w, dtype=np.float64))
    types = [cm.devices[r].type_key for r in ranks]
    kinds = list(per_type)
    mult = [types.count(k) for k in kinds]
    candidates = np.unique(np.concatenate([t[1:] for t in per_type.values()]))

    def take(T: float) -> list[int]:
        """Per device type: the most samples within T."""
        return [int(np.searchsorted(per_type[k], T, side="right")) - 1 for k in kinds]

    lo, hi = 0, len(candidates) - 1  # the least candidate time whose takes cover the samples
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(m * t for m, t in zip(mult, take(float(candidates[mid])), strict=True)) >= samples:
            hi = mid
        else:
            lo = mid + 1
    per_kind = dict(zip(kinds, take(float(candidates[lo])), strict=True))
    counts = [per_kind[k] for k in types]
    excess = sum(counts) - samples
    # trim from the ranks with the most (the lowest rank first among equals): all within T
    heap = [(-c, i) for i, c in enumerate(counts)]
    heapq.heapify(heap)
    while excess > 0:
        c, i = heapq.heappop(heap)
        counts[i] -= 1
        excess -= 1
        heapq.heappush(heap, (c + 1, i))
    return counts


def formations(cm: CostModel, stages: int) -> list[list[list[int]]]:
    """The candidate node formations of `stages` stages: lists of each stage's ranks."""
    nodes = node_groups(cm)
    n = len(nodes)
    if stages > n:
        return []
    orders: list[tuple[int, ...]]
    if n <= ALL_ORDERS_UP_TO:
        orders = list(itertools.permutations(range(n)))
    else:  # the cluster's order, and the nodes with the most memory first (1F1B's first
        # stages hold the most micro-batches)
        memory = [-sum(cm.devices[r].memory_bytes for r in nodes[k]) for k in range(n)]
        orders = [tuple(range(n)), tuple(sorted(range(n), key=lambda k: memory[k]))]
    if n <= ALL_CUTS_UP_TO:
        cuts = [c for c in itertools.combinations(range(1, n), stages - 1)]
    else:  # runs of equal node counts (the first ones one longer)
        size, extra = divmod(n, stages)
        bounds, at = [], 0
        for s in range(stages - 1):
            at += size + (1 if s < extra else 0)
            bounds.append(at)
        cuts = [tuple(bounds)]
    out, seen = [], set()
    for order in orders:
        for cut in cuts:
            edges = (0, *cut, n)
            groups = [
                sorted(r for k in order[edges[i] : edges[i + 1]] for r in nodes[k])
                for i in range(stages)
            ]
            key = tuple(cm.group_key(g) for g in groups)
            if key in seen:  # the same kinds of stage in the same order: the same plans
                continue
            seen.add(key)
            out.append(groups)
    return out


def micro_batch_counts(global_batch: int, stages: int) -> list[int]:
    """M: the divisors of the global batch from S to MICRO_BATCHES_PER_STAGE x S."""
    top = min(global_batch, MICRO_BATCHES_PER_STAGE * stages)
    return [m for m in range(stages, top + 1) if global_batch % m == 0]


def plan_formation(
    cm: CostModel,
    global_batch: int,
    groups: list[list[int]],
    micro_batches: int,
    schedule: str,
    cache: dict | None = None,
    model_name: str | None = None,
    predict: bool = True,
    bound: float = math.inf,
) -> Plan | None:
    """The best staged plan of one formation at one M and schedule (the exact cut), or None
    where no cut fits (or none is faster than `bound`). `predict` False: the plan without the cost model's per-rank predictions,
    its `predicted.step_s` the cut's (the search fills the winner's alone)."""
    cache = cache if cache is not None else {}
    S = len(groups)
    samples = global_batch // micro_batches
    splits = []
    for ranks in groups:
        split_key = ("split", tuple(ranks), samples)
        if split_key not in cache:
            cache[split_key] = micro_split(cm, ranks, samples)
        splits.append(cache[split_key])
    if math.isfinite(bound) and cm.blocks_floor_s(groups, splits, micro_batches) >= bound:
        return None  # even its blocks alone cannot beat the bound
    tables: list[StageTables] = []
    for pos, (ranks, split) in enumerate(zip(groups, splits, strict=True)):
        flight = in_flight(schedule, pos, S, micro_batches)
        key = (tuple(ranks), tuple(split), flight, micro_batches, schedule)
        if key not in cache:
            cache[key] = cm.stage_tables(ranks, split, pos, S, micro_batches, schedule)
        tables.append(cache[key])
    links = [cm.link_s(groups[i], groups[i + 1], samples) for i in range(S - 1)]
    tied = cm.tied_exchange_s(groups[0], groups[-1])
    cut = best_cuts(tables, links, micro_batches, bound, tied)
    if cut is None:
        return None
    ranks: list[RankPlan | None] = [None] * len(cm.devices)
    stages = []
    for ranks_of, split, tab, (a, b) in zip(groups, splits, tables, cut.ranges, strict=True):
        stages.append(Stage(ranks=list(ranks_of), units=[a, b], keep_gathered=bool(tab.keep[a, b])))
        for i, r in enumerate(ranks_of):
            m = split[i]
            ranks[r] = RankPlan(
                rank=r,
                device=cm.devices[r].type_key,
                batch_size=m * micro_batches,
                micro_batch_size=max(m, 1),
                num_micro_batches=micro_batches if m else 0,
                state_fraction=float(tab.fractions[tab.index[i], a, b]),
            )
    plan = Plan(
        strategy="cephalo",
        model=model_name or cm.model.name,
        seq_len=cm.seq_len,
        global_batch_size=global_batch,
        dtype=cm.dtype,
        ranks=ranks,  # type: ignore[arg-type]
        meta=dict(cm.meta),
        stages=stages,
        schedule=schedule,
        num_micro_batches=micro_batches,
    )
    plan.validate()
    if predict:
        from cephalo.planner.choice import fill_predictions

        fill_predictions(cm, plan)
    else:
        plan.predicted = Predicted(cut.step_s, global_batch / cut.step_s, 0.0)
    return plan


def best_staged_plan(
    cm: CostModel,
    global_batch: int,
    stages: str | int = "auto",
    schedule: str = "auto",
    model_name: str | None = None,
    bound: float = math.inf,
) -> tuple[Plan | None, list[dict]]:
    """The fastest staged plan over the candidates (module docstring) faster than `bound` (the
    step of a plan without stages), and per stage count its best predicted step (None where
    nothing fits or is faster)."""
    stages = parse_stages(stages)
    if schedule not in ("auto", *SCHEDULES):
        raise CephaloError(f"schedule {schedule!r} is not one of auto, {', '.join(SCHEDULES)}")
    nodes = len(node_groups(cm))
    if stages == "off":
        return None, []
    _check_count(stages, nodes)
    if stages != "auto":
        counts: list[int] = [stages]
    elif nodes <= ALL_CUTS_UP_TO:
        counts = list(range(2, min(nodes, MAX_STAGES) + 1))
    else:  # many nodes: 2, 4, 8 stages
        counts = [c for c in (2, 4, 8) if c <= min(nodes, MAX_STAGES)]
    schedules = ["1f1b"] if schedule == "auto" else [schedule]
    cache: dict = {}
    best: Plan | None = None
    summary = []
    for S in counts:
        best_s = math.inf
        for groups in formations(cm, S):
            for M in micro_batch_counts(global_batch, S):
                for sched in schedules:
                    limit = min(bound, best.predicted.step_s if best is not None else bound)  # type: ignore[union-attr]
                    plan = plan_formation(
                        cm, global_batch, groups, M, sched, cache, model_name, False, limit
                    )
                    if plan is None or plan.predicted is None:
                        continue
                    best_s = min(best_s, plan.predicted.step_s)
                    if best is None or plan.predicted.step_s < best.predicted.step_s:  # type: ignore[union-attr]
                        best = plan
        row: dict = {"stages": S, "step_s": best_s if math.isfinite(best_s) else None}
        if not math.isfinite(best_s) and math.isfinite(bound):
            row["slower_than_s"] = bound  # none fits, or none is faster than the plan without
        summary.append(row)
    if best is not None:
        from cephalo.planner.choice import fill_predictions

        fill_predictions(cm, best)
    return best, summary


def _check_count(stages: str | int, nodes: int) -> None:
    if isinstance(stages, int) and stages > nodes:
        raise CephaloError(
            f"{stages} stages need at least {stages} nodes but the cluster has {nodes}: a stage "
            "is made of whole nodes (mark them with @nodeK in the cluster spec)"
        )


def make_staged_plan(
    cm: CostModel,
    global_batch: int,
    stages: str | int = "auto",
    schedule: str = "auto",
    hierarchy: bool = True,
    reduce_dtype: str = "fp32",
    **planner_kw,
) -> Plan:
    """The fastest of today's plan (flat or shard groups, `make_hierarchical_plan`) and the
    staged candidates; `stages="off"`: today's plan alone. `meta["stage_counts"]` lists each
    stage count's best step."""
    started = time.perf_counter()
    stages = parse_stages(stages)
    _check_count(stages, len(node_groups(cm)))  # before any planning
    error: PlanDoesNotFit | None = None
    try:
        best: Plan | None = make_hierarchical_plan(
            cm, global_batch, hierarchy=hierarchy, reduce_dtype=reduce_dtype, **planner_kw
        )
    except PlanDoesNotFit as e:
        if stages == "off":
            raise
        best, error = None, e
    if stages == "off":
        assert best is not None
        return best
    staged, summary = best_staged_plan(
        cm,
        global_batch,
        stages,
        schedule,
        model_name=planner_kw.get("model_name"),
        bound=best.predicted.step_s if best is not None else math.inf,  # type: ignore[union-attr]
    )
    if staged is not None and (
        best is None or staged.predicted.step_s < best.predicted.step_s  # type: ignore[union-attr]
    ):
        staged.meta["groupings"] = (best.meta.get("groupings") if best is not None else None) or [
            {"grouping": "flat", "step_s": None}
        ]
        best = staged
    if best is None:
        assert error is not None
        raise error
    best.meta["stage_counts"] = summary
    best.meta["planner_wall_s"] = round(time.perf_counter() - started, 6)
    return best


def stage_lines(plan: Plan) -> list[str]:
    """For `cephalo plan` and `simulate`: the stages of the plan and each stage count's step."""
    lines = []
    if plan.staged:
        assert plan.stages is not None
        parts = []
        for i, st in enumerate(plan.stages):
            g = st.ranks
            if len(g) == 1:
                ranks = str(g[0])
            elif g == list(range(g[0], g[-1] + 1)):
                ranks = f"{g[0]}-{g[-1]}"
            else:
                ranks = str(g)
            a, b = st.units
            mode = "kept" if st.keep_gathered else "per mb"
            parts.append(f"{i}: ranks {ranks} units {a}-{b} ({mode})")
        lines.append(
            f"pipeline stages ({plan.schedule}, {plan.num_micro_batches} micro-batches of "
            f"{plan.global_batch_size // (plan.num_micro_batches or 1)}): " + "; ".join(parts)
        )
    tried = plan.meta.get("stage_counts") or []
    if tried:
        text = ", ".join(
            f"{t['stages']} {t['step_s']:.4g} s"
            if t.get("step_s") is not None
            else f"{t['stages']} > {t['slower_than_s']:.4g} s or does not fit"
            if "slower_than_s" in t
            else f"{t['stages']} does not fit"
            for t in tried
        )
        lines.append(f"stages (predicted step): {text}")
    return lines
