"""The planner: choose each rank's batch, micro-batch, state fraction and offload to maximise throughput.

For a global batch B the throughput is B / T, so the planner minimises the step time T =
max over ranks of t_i subject to every rank's memory. All numbers come from
`cephalo.costmodel.model`; the planner only searches.

The search (docs/planner.md has the long form):

1. Ranks with the same device type and memory are one *group*: they share every table.
2. For each group, tabulate over batch b and options (micro-batch m, offload o) the rank's
   time without the optimizer, C(b, m, o), and its memory without the state, M(b, m, o).
   Keep, per b, only the Pareto-optimal options (faster or leaner than every other).
3. For a candidate step time T, a rank taking b samples can own at most
   cap(b; T) = max over options of min((M_i - M(b,.)) / 16P, (T - C(b,.)) / (P * opt_s)),
   the memory left after its activations and the time left for its optimizer both
   bounding its state fraction. cap is non-increasing in b (a bigger batch never needs
   less time or memory at the best micro-batch) and non-decreasing in T.
4. T is feasible iff some split sum b_i = B has sum cap_i(b_i) >= 1. Small instances solve
   this exactly with a max-plus dynamic program over ranks; large ones with a greedy over
   each group's upper concave hull of cap (the Lagrangian relaxation; identical ranks take
   hull vertices, at most one per group lies between two, evaluated at its true value, so
   every plan it returns is feasible). T is found by bisection.
5. With (b, m, o) fixed, the fractions are water-filled: the smallest T' with
   sum_i min(memory cap_i, (T' - C_i) / (P * opt_i)) >= 1, then s_i at those caps.

Two more per-rank choices where the cost model knows the cluster (`CostModel.host`,
`CostModel.serial_reduce`): an option may wait for each reduce-scatter at once (one unit
gradient less, the reduce-scatter no longer hidden), and a rank may keep a part x of the model's
state on the host (`host_state_fraction` h = x / s). With host state, cap(b; T) becomes a
small linear programme per (b, option): maximise x + y (y: the device-held part) under the
device memory (16 P bytes per unit of y, d P per unit of x), the rank's share of its node's host
memory, and the time left (the device optimizer on y; on x the gradient copies, the host AdamW
and the uploads: added on a CPU, beside the device optimizer on a GPU). Its optimum lies at
x = 0, at the largest x, or where the memory and time bounds on y cross, so it stays closed
form. The water-filling then solves the same programme per rank, and each rank keeps on the
host the least part its memory needs, or more only where that makes it faster.

Baselines from the same cost model: `even` (plain FSDP: equal batches, equal shards) and
`proportional` (batch proportional to each device's solo speed, equal shards).

This module holds the entry points (`make_plan`, and `manual_plan` / `simple_plan` for plans
without a search); each step above has its own module:

- rank_tables.py: the groups and their [b, option] tables (steps 1, 2);
- rank_capacity.py: cap(b; T), with host state its linear programme (step 3);
- batch_split.py: the split of B at a step time T, exact or over the hulls (step 4);
- optimiser.py: the bisection over T, and the search where near-even splits pay their padding
  (padded_search.py);
- water_fill.py: the fractions for a fixed split (step 5);
- plan_choice.py: the search's per-rank choices and the plan made of them;
- baselines.py: `even` and `proportional`; does_not_fit.py: why nothing fits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from cephalo.costmodel.model import CostModel
from cephalo.errors import CephaloError
from cephalo.log import logger
from cephalo.planner.baselines import equal_shards, even_batches, proportional_batches
from cephalo.planner.choice import choice_to_plan
from cephalo.planner.plan import Plan, RankPlan, largest_remainder
from cephalo.planner.search.bisection import optimise_charged, unless_marginal
from cephalo.planner.search.rank_tables import SearchRegime, TableCache
from cephalo.specs.cluster import Cluster

PLANNER_STRATEGIES = ("cephalo", "even", "proportional")
HOST_STATE_MIN_GAIN = 0.03
"""Host state, and ranks waiting for each reduce-scatter, must each make the predicted step at
least this much shorter than the best plan without them, or that plan is kept: they trade time
for memory (host state also costs host memory and a host CPU busy with the optimizer), and
smaller gains are within the model's error (a few percent on the emulated devices,
bench/results/hetero_throughput.md)."""


def make_plan(
    cost_model: CostModel,
    global_batch: int,
    strategy: str = "cephalo",
    allow_offload: bool = True,
    model_name: str | None = None,
    allow_host_state: bool = True,
    host_state_min_gain: float = HOST_STATE_MIN_GAIN,
    explain: bool = True,
    tables: TableCache | None = None,
) -> Plan:
    """Make a plan for `global_batch` samples per step (see the module docstring).

    `allow_host_state=False` keeps all training state on the devices even where the cost model
    knows the hosts (the plan to compare with); a plan with host state is only returned where
    its predicted step is at least `host_state_min_gain` shorter than that of the best plan
    without (or where none fits without). `explain=False`: a plan that does not fit raises a
    `PlanDoesNotFit` without working out why (searches that only need to know, such as the
    split over shard groups, skip the search for the largest batch that fits). `tables`: the
    rank tables earlier plans of this very cost model made (the split over shard groups plans
    one group at many batch sizes); None: this plan's own."""
    if global_batch < 1:
        raise CephaloError(f"the global batch must be >= 1, got {global_batch}")
    if strategy not in PLANNER_STRATEGIES:
        raise CephaloError(
            f"unknown strategy {strategy!r}; choose one of {', '.join(PLANNER_STRATEGIES)}"
        )
    started = time.perf_counter()
    if strategy == "cephalo":
        allowed = SearchRegime(
            offload=allow_offload,
            host=allow_host_state
            and cost_model.host is not None
            and not cost_model.adapter.frozen_base,
            serial=cost_model.serial_reduce,
        )
        # every search of this plan (with and without host state or serial reduces, and the
        # padded search's sub-searches) shares the tables it has made
        tables = tables if tables is not None else TableCache(cost_model)
        choice = optimise_charged(cost_model, global_batch, allowed, explain, tables)
        if allowed.host and choice.host is not None and any(h > 0 for h in choice.host):
            choice, allowed = unless_marginal(
                cost_model, global_batch, allowed, choice, "host", host_state_min_gain, tables
            )
        if allowed.serial and choice.overlap is not None and not all(choice.overlap):
            choice, _ = unless_marginal(
                cost_model, global_batch, allowed, choice, "serial", host_state_min_gain, tables
            )
    else:
        batches = (
            even_batches(len(cost_model.devices), global_batch)
            if strategy == "even"
            else proportional_batches(cost_model, global_batch)
        )
        choice = equal_shards(cost_model, batches, allow_offload, strategy)
    elapsed = time.perf_counter() - started
    plan = choice_to_plan(cost_model, global_batch, strategy, choice, model_name)
    plan.meta["planner_wall_s"] = round(elapsed, 6)
    logger.debug(
        "planned %s for %d devices, batch %d, in %.3f s",
        strategy,
        len(cost_model.devices),
        global_batch,
        elapsed,
    )
    return plan


def manual_plan(
    model: str,
    seq_len: int,
    batches: Sequence[int],
    micro_batches: Sequence[int],
    fractions: Sequence[float],
    device_keys: Sequence[str] | None = None,
    offload: Sequence[bool] | bool = False,
    dtype: str = "fp32",
    strategy: str = "manual",
    meta: dict | None = None,
) -> Plan:
    """A plan from explicit per-rank choices (tests, benchmarks, hand-made baselines): each
    micro-batch is clipped to its rank's batch, and a rank without samples gets one dummy
    micro-batch size and none to run. Validated like any plan."""
    n = len(batches)
    keys = list(device_keys) if device_keys is not None else ["cpu"] * n
    offloads = [offload] * n if isinstance(offload, bool) else list(offload)
    ranks = []
    for i, (b, m, f, key, o) in enumerate(
        zip(batches, micro_batches, fractions, keys, offloads, strict=True)
    ):
        m = max(1, min(m, b)) if b else 1
        ranks.append(RankPlan(i, key, b, m, math.ceil(b / m), f, offload_activations=o))
    plan = Plan(strategy, model, seq_len, sum(batches), dtype, ranks, meta=dict(meta or {}))
    plan.validate()
    return plan


def simple_plan(
    strategy: str, cluster: Cluster, model_name: str, seq_len: int, global_batch: int, dtype: str
) -> Plan:
    """`even` (equal batches) or `proportional` (batches in proportion to each device's speed,
    1 / slowdown) with equal state shards and one micro-batch per rank: the FSDP-style
    baselines, made without a profile (`parallel.plan = even | proportional`)."""
    n = cluster.world_size
    if strategy == "even":
        batches = largest_remainder(global_batch, [1.0] * n)
    else:
        if any(d.type != "cpu" for d in cluster.devices):
            logger.warning(
                "plan = proportional without a profile treats every GPU as equally fast; "
                "use plan = auto (measured speeds) for a real heterogeneous cluster"
            )
        batches = largest_remainder(global_batch, [1.0 / d.slowdown for d in cluster.devices])
    return manual_plan(
        model_name,
        seq_len,
        batches,
        batches,
        [1.0 / n] * n,
        device_keys=[d.type_key for d in cluster.devices],
        dtype=dtype,
        strategy=strategy,
        meta={"cluster": cluster.describe()},
    )
