"""The planner's per-rank choices (`Choice`) and their conversion to a `Plan` with its predictions.

Every search (optimiser.py, baselines.py) answers with a `Choice`; `choice_to_plan` makes it a
plan, `fill_predictions` writes the cost model's predictions into any plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cephalo.costmodel.model import CostModel
from cephalo.planner.plan import Plan, Predicted, RankPlan


@dataclass
class Choice:
    """Per rank: batch, micro-batch, offload, state fraction (and host part, reduce overlap)."""

    batch: list[int]
    micro: list[int]
    offload: list[bool]
    fraction: list[float]
    host: list[float] | None = None
    """host_state_fraction per rank (None: all 0)."""
    overlap: list[bool] | None = None
    """overlap_reduce per rank (None: all True)."""
    fuse: list[bool] | None = None
    """fuse_tail per rank (None: all True)."""
    lower: float = 0.0
    """A step time no plan of the search that made it reaches (its bisection's infeasible end)."""


def choice_to_plan(
    cm: CostModel,
    B: int,
    strategy: str,
    c: Choice,
    model_name: str | None,
    predict: bool = True,
) -> Plan:
    ranks = []
    for i, d in enumerate(cm.devices):
        b = c.batch[i]
        m = max(1, min(c.micro[i], b)) if b > 0 else 1
        ranks.append(
            RankPlan(
                rank=i,
                device=d.type_key,
                batch_size=b,
                micro_batch_size=m,
                num_micro_batches=math.ceil(b / m),
                state_fraction=c.fraction[i],
                offload_activations=bool(c.offload[i] and b > 0),
                host_state_fraction=(
                    round(c.host[i], 12) if c.host is not None and c.fraction[i] > 0 else 0.0
                ),
                overlap_reduce=True if c.overlap is None else bool(c.overlap[i]),
                fuse_tail=True if c.fuse is None else bool(c.fuse[i]),
            )
        )
    plan = Plan(
        strategy=strategy,
        model=model_name or cm.model.name,
        seq_len=cm.seq_len,
        global_batch_size=B,
        dtype=cm.dtype,
        ranks=ranks,
        meta=dict(cm.meta),
    )
    if predict:
        fill_predictions(cm, plan)
    return plan


def fill_predictions(cm: CostModel, plan: Plan) -> None:
    """Write the cost model's per-rank and whole-step predictions into the plan."""
    ev = cm.evaluate(plan)
    for r, cost in zip(plan.ranks, ev.ranks, strict=True):
        r.predicted_step_s = cost.step_s
        r.predicted_peak_memory_bytes = cost.peak_bytes
        r.predicted_host_bytes = cost.host_bytes if cm.host is not None else None
    plan.predicted = Predicted(
        step_s=ev.step_s, samples_per_s=ev.samples_per_s, tokens_per_s=ev.tokens_per_s
    )
