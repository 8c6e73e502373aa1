"""Pipeline stages on 3 emulated nodes with a slow link between them (issue 40).

EMULATED: 5 CPU ranks on this host in 3 nodes of 2, 1 and 2 ranks (SPEC), each node's ranks
slowed by its own factor (`slowdown=`), the nodes joined by a slow link (`inter=RATE`); every
rank runs its collectives on the faithful emulated comm (runtime/collectives/emulated.py: one
queue per process group at its slowest link, asynchronous waits, as NCCL runs them), the
boundaries between stages on the pipeline's point-to-point exchange charged at the same link
(runtime/pipeline/exchange.py), the all-reduce between shard groups at the node's link
(runtime/collectives/shard_groups.py). Within a node the collectives run at gloo's speed.

`profile_devices` measures the three kinds of rank, one rank at a time by its thread's CPU
time x its slowdown (`concurrent=False`: what the engine's emulator makes a piece last when
the slowdown exceeds the host's contention; measured together by the wall clock on this
loaded 2-core host, the profiles came out up to 2x the engine's compute); rank 0's cost model
over those profiles gives three plans, which every rank runs:

- flat: one shard group of all 5 ranks (`--no-hierarchy`): every unit's all-gathers and
  reduce-scatters ring over the slow link;
- shard groups: one per node (`plan_grouping`, the per-node grouping): rings inside the nodes,
  the gradient all-reduced between the nodes once per step;
- stages: the planner's choice with `--stages 3` (`best_staged_plan`): each node a stage, only
  the boundary activations and their gradients cross the link (where the planner finds none
  or the runtime would refuse it, `hand_staged_plan`, said in the summary).

The engine runs the three side by side, in rotated order (flat, groups, stages; groups,
stages, flat; ...), each step timed from a barrier to the slowest rank's end; the first round
warms up. The medians are compared with each other and with the cost model's predicted steps.
The planner's own pick (`make_staged_plan`, `--stages auto`) is printed too.

Targets (issue 40): stages >= 1.3x shard groups and >= 2x flat, measured; the stages' predicted
step within 10 % of the measured.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.distributed as dist

from _common import RankPool, Result, alternate, markdown_table, median, save_figure, verdict

MODEL = "gpt-small-demo"
SEQ_LEN = 32
BATCH = 16
N_LAYER = 6
RATE = "8MB/s"
NODES = "2xcpu@node0:slowdown=8,1xcpu@node1:slowdown=6,2xcpu@node2:slowdown=10"
PLANS = ("flat", "shard groups", "stages")


def spec(rate: str) -> str:
    return f"{NODES};inter={rate}"


def _plans(cm, batch: int):
    """The three plans (module docstring), the planner's own pick, and a note where the staged
    plan is a hand-written one."""
    from cephalo.errors import CephaloError
    from cephalo.planner.plan import check_stages_runnable
    from cephalo.planner.shard_groups import (
        candidate_groupings,
        make_hierarchical_plan,
        plan_grouping,
    )
    from cephalo.planner.stages.search import best_staged_plan, make_staged_plan

    flat = make_hierarchical_plan(cm, batch, hierarchy=False, model_name=MODEL)
    per_node = candidate_groupings(cm)[0]
    groups = plan_grouping(cm, batch, per_node, "fp32", model_name=MODEL).plan
    staged, _ = best_staged_plan(cm, batch, stages=3, model_name=MODEL)
    note = ""
    try:
        if staged is None:
            raise CephaloError("the planner found no 3-stage plan that fits")
        check_stages_runnable(staged, "the planner's 3-stage plan")
    except CephaloError as e:  # the runtime would refuse it: each node a stage, by hand
        staged, note = hand_staged_plan(cm, batch), f"{e}; a hand-written plan instead"
    chosen = make_staged_plan(cm, batch, stages="auto", model_name=MODEL)
    return {"flat": flat, "shard groups": groups, "stages": staged}, chosen, note


def hand_staged_plan(cm, batch: int, micro_batches: int = 4):
    """Each node a stage in the cluster's order, the units in equal runs, each micro-batch and
    the stage's state split evenly over its ranks, 1F1B, weights kept gathered."""
    from cephalo.planner.choice import fill_predictions
    from cephalo.planner.plan import Plan, RankPlan, Stage
    from cephalo.planner.shard_groups import node_groups

    nodes = node_groups(cm)
    units, per = cm.num_units, batch // micro_batches
    edges = [round(i * units / len(nodes)) for i in range(len(nodes) + 1)]
    ranks: list = [None] * len(cm.devices)
    stages = []
    for k, members in enumerate(nodes):
        stages.append(Stage(list(members), [edges[k], edges[k + 1] - 1], True))
        for i, r in enumerate(members):
            rows = per // len(members) + (1 if i < per % len(members) else 0)
            ranks[r] = RankPlan(
                r,
                cm.devices[r].type_key,
                rows * micro_batches,
                max(rows, 1),
                micro_batches if rows else 0,
                1.0 / len(members),
            )
    plan = Plan(
        "manual",
        MODEL,
        cm.seq_len,
        batch,
        cm.dtype,
        ranks,
        stages=stages,
        schedule="1f1b",
        num_micro_batches=micro_batches,
    )
    plan.validate()
    fill_predictions(cm, plan)
    return plan


def describe(plan) -> str:
    """A plan in one line: stages (ranks, units, rows of a micro-batch) or (batch, state) per rank."""
    if plan.staged:
        parts = []
        for st in plan.stages:
            rows = [
                plan.ranks[r].micro_batch_size if plan.ranks[r].batch_size else 0 for r in st.ranks
            ]
            keep = "kept" if st.keep_gathered else "per mb"
            parts.append(f"ranks {st.ranks} units {st.units[0]}-{st.units[1]} rows {rows} ({keep})")
        return f"{plan.schedule}, M={plan.num_micro_batches}: " + "; ".join(parts)
    return str([(r.batch_size, round(r.state_fraction, 2)) for r in plan.ranks])


def stage_terms(cm, plan) -> dict:
    """A staged plan's terms as the cost model charges them (costmodel/stages.py, read from its
    `stage_tables`): per stage its time per micro-batch and once-per-step overhead, per crossing
    its link time; with M, what `pipeline_step_s` takes."""
    stages, M = plan.stages, plan.num_micro_batches
    times, overheads = [], []
    for pos, st in enumerate(stages):
        micro = [
            plan.ranks[r].micro_batch_size if plan.ranks[r].batch_size else 0 for r in st.ranks
        ]
        tab = cm.stage_tables(
            st.ranks,
            micro,
            pos,
            len(stages),
            M,
            plan.schedule,
            fractions=[plan.ranks[r].state_fraction for r in st.ranks],
            keep=st.keep_gathered,
        )
        a, b = st.units
        times.append(float(tab.time[a, b]))
        overheads.append(float(tab.overhead[a, b]))
    samples = plan.global_batch_size // M
    links = [
        cm.link_s(stages[i].ranks, stages[i + 1].ranks, samples) for i in range(len(stages) - 1)
    ]
    return {"times": times, "overheads": overheads, "links": links, "M": M}


def _plan_on_rank0(rate: str, batch: int, n_layer: int, measured) -> dict:
    """Rank 0's cost model and plans (every rank would plan the same from the same profiles)."""
    from cephalo.costmodel.sources import measured_cost_model
    from cephalo.modeling.registry import build_model
    from cephalo.specs.cluster import Cluster

    cluster = Cluster.parse(spec(rate))
    ov = {"n_layer": n_layer, "tie_embeddings": False, "dropout": 0.0}
    cm = measured_cost_model(cluster, build_model(MODEL, **ov).spec, SEQ_LEN, "fp32", measured)
    t0 = time.perf_counter()
    plans, chosen, note = _plans(cm, batch)
    return {
        "plans": plans,
        "note": note,
        "plan_s": time.perf_counter() - t0,
        "chosen": describe(chosen),
        "chosen_step_s": chosen.predicted.step_s,
        "rank_predicted": {
            k: [(c.compute_s, c.optimizer_s) for c in cm.evaluate(p).ranks]
            for k, p in plans.items()
        },
        "terms": stage_terms(cm, plans["stages"]),
    }


def _run(rate: str, batch: int, n_layer: int, rounds: int, cache: str) -> dict:
    from _systems import OursTrainer, make_data
    from cephalo.modeling.registry import build_model
    from cephalo.profiling.profiler import profile_devices
    from cephalo.profiling.settings import ProfileSettings
    from cephalo.runtime.collectives.comm import make_comm
    from cephalo.specs.cluster import Cluster

    torch.set_num_threads(1)
    rank = dist.get_rank()
    cluster = Cluster.parse(spec(rate))
    ov = {"n_layer": n_layer, "tie_embeddings": False, "dropout": 0.0}
    # one rank at a time, by its thread's CPU time x its slowdown (results file: why)
    settings = ProfileSettings(
        repeats=9,
        warmup=2,
        time_cap_s=6.0,
        max_micro_batch=8,
        per_sample_dropout=False,
        concurrent=False,
    )
    t0 = time.perf_counter()
    measured = profile_devices(
        MODEL,
        SEQ_LEN,
        "fp32",
        cluster,
        make_comm("auto", validate=False),
        settings,
        cache=cache,
        **ov,
    )
    profile_s = time.perf_counter() - t0
    box = [_plan_on_rank0(rate, batch, n_layer, measured) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    out = {**box[0], "rank": rank, "profile_s": profile_s}
    out["times"] = {k: [] for k in out["plans"]}
    out["rank_measured"] = {k: [] for k in out["plans"]}
    if rounds <= 0:
        return out
    slowdown = cluster.devices[rank].slowdown
    inter = cluster.inter_node_bytes_per_s
    systems = {
        k: OursTrainer(
            MODEL, ov, p, slowdown=slowdown, inter_node_bytes_per_s=inter, cluster=cluster
        )
        for k, p in out["plans"].items()
    }
    x, y = make_data(batch, SEQ_LEN, build_model(MODEL, **ov).spec.vocab_size)
    for i, name in enumerate(alternate(rounds + 1, list(systems))):
        dist.barrier()
        t0 = time.perf_counter()
        stats = systems[name].step(x, y)
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= len(systems):  # the first round warms up
            out["times"][name].append(float(dt))
            out["rank_measured"][name].append((stats.busy_s, stats.optimizer_s, stats.comm_wait_s))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds (0: predictions only)")
    ap.add_argument("--rate", default=RATE, help="the inter-node link")
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--n-layer", type=int, default=N_LAYER)
    args = ap.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:
        pool = RankPool(5, timeout_s=3600).start()
        try:
            per_rank = pool.run(
                _run, args.rate, args.batch, args.n_layer, args.rounds, f"{cache}/profiles.json"
            )
        finally:
            pool.close()
    wall = time.perf_counter() - started
    res = per_rank[0]
    res["plan_lines"] = {k: describe(p) for k, p in res["plans"].items()}
    res["predicted"] = {k: p.predicted.step_s for k, p in res["plans"].items()}
    print(f"wall {wall:.0f} s, profiling {res['profile_s']:.0f} s, planning {res['plan_s']:.1f} s")
    for k in PLANS:
        print(
            f"{k}: predicted {res['predicted'][k]:.3f} s  times {res['times'][k]}  {res['plan_lines'][k]}"
        )
    print(f"chosen ({res['chosen_step_s']:.3f} s): {res['chosen']}")
    if args.rounds <= 0:
        return
    write(res, per_rank, args, wall)


def write(res: dict, per_rank: list[dict], args, wall: float) -> None:
    from cephalo.costmodel.stages import pipeline_step_s

    med = {k: median(v) for k, v in res["times"].items()}
    pred = res["predicted"]
    err = {k: pred[k] / med[k] - 1 for k in med}
    over_groups = med["shard groups"] / med["stages"]
    over_flat = med["flat"] / med["stages"]
    ok_groups, ok_flat = over_groups >= 1.3, over_flat >= 2.0
    ok_pred = abs(err["stages"]) <= 0.10
    rows = [
        [
            k,
            f"{med[k]:.3f}",
            f"{pred[k]:.3f}",
            f"{err[k]:+.1%}",
            f"{med[k] / med['stages']:.2f}",
            f"{pred[k] / pred['stages']:.2f}",
            res["plan_lines"][k],
        ]
        for k in PLANS
    ]
    # per rank: the cost model's compute and optimizer against the engine's (medians)
    busy = {k: [median([m[0] for m in r["rank_measured"][k]]) for r in per_rank] for k in PLANS}
    opt = {k: [median([m[1] for m in r["rank_measured"][k]]) for r in per_rank] for k in PLANS}
    wait = {k: [median([m[2] for m in r["rank_measured"][k]]) for r in per_rank] for k in PLANS}
    rank_rows = [
        [
            k,
            r,
            f"{res['rank_predicted'][k][r][0]:.3f}",
            f"{busy[k][r]:.3f}",
            f"{res['rank_predicted'][k][r][1]:.3f}",
            f"{opt[k][r]:.3f}",
            f"{wait[k][r]:.3f}",
        ]
        for k in PLANS
        for r in range(len(per_rank))
    ]
    # the pipeline's formula over the engine's own compute: which part a miss comes from
    terms = res["terms"]
    plan = res["plans"]["stages"]
    M = terms["M"]
    measured_t = [max(busy["stages"][r] for r in st.ranks) / M for st in plan.stages]
    formula = pipeline_step_s(measured_t, terms["overheads"], terms["links"], M)
    stage_rows = [
        [
            i,
            str(st.ranks),
            f"{st.units[0]}-{st.units[1]}",
            f"{terms['times'][i] * 1e3:.0f}",
            f"{measured_t[i] * 1e3:.0f}",
            f"{terms['overheads'][i] * 1e3:.0f}",
            f"{terms['links'][i] * 1e3:.0f}" if i < len(terms["links"]) else "—",
        ]
        for i, st in enumerate(plan.stages)
    ]
    summary = [
        markdown_table(
            [
                "plan",
                "measured step s (median)",
                "predicted s",
                "prediction error",
                "measured / stages",
                "predicted / stages",
                "plan",
            ],
            rows,
            "lrrrrrl",
        ),
        f"Stages over shard groups, measured: **{over_groups:.2f}x** (target >= 1.3x: "
        f"{verdict(ok_groups)}); over flat **{over_flat:.2f}x** (target >= 2x: "
        f"{verdict(ok_flat)}); the stages' prediction within {abs(err['stages']):.1%} "
        f"(target 10 %: {verdict(ok_pred)}). The pipeline's formula over the engine's own "
        f"compute per stage (below) gives {formula:.3f} s ({formula / med['stages'] - 1:+.1%} of "
        f"the measured step). The planner's own pick (`--stages auto`): {res['chosen']}, "
        f"predicted {res['chosen_step_s']:.3f} s."
        + (f" **{res['note']}.**" if res["note"] else ""),
    ]
    details = [
        "Per stage of the staged plan: the cost model's time per micro-batch (t_s, the slowest "
        "rank's compute from the profiles), the engine's (the slowest rank's median busy "
        "seconds / M), the once-per-step overhead o_s and the crossing to the next stage "
        "(costmodel/stages.py):",
        markdown_table(
            ["stage", "ranks", "units", "t_s predicted ms", "t_s measured ms", "o_s ms", "link ms"],
            stage_rows,
        ),
        "Per rank and plan: compute (forward + recompute + backward) and optimizer seconds per "
        "step, predicted and measured (`StepStats.busy_s`, `optimizer_s`; medians), and the "
        "engine's waits for collectives and boundaries:",
        markdown_table(
            [
                "plan",
                "rank",
                "compute predicted s",
                "compute measured s",
                "optimizer predicted s",
                "optimizer measured s",
                "waits s",
            ],
            rank_rows,
        ),
        __doc__.split("\n\n", 1)[1],
    ]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.bar(list(PLANS), [med[k] for k in PLANS], color=["0.6", "C1", "C0"], label="measured")
    ax.scatter(list(PLANS), [pred[k] for k in PLANS], color="C3", zorder=3, label="predicted")
    ax.set_ylabel("step s")
    ax.set_title(f"3 emulated nodes (2 + 1 + 2 ranks), inter={args.rate}")
    ax.legend()
    fig.tight_layout()
    figure = save_figure(fig, "pipeline", "emulated")
    Result(
        name="pipeline",
        title="Pipeline stages on 3 emulated nodes",
        emulated=f"5 CPU ranks `{spec(args.rate)}`: compute stretched by each node's slowdown, "
        f"a delay per byte at {args.rate} on traffic between nodes. Model {MODEL} with "
        f"{args.n_layer} layers, seq {SEQ_LEN}, fp32, global batch {args.batch}.",
        summary=summary,
        details=details,
        figures=[figure],
    ).write(wall)
    print("\n\n".join(summary + details[:4]))


if __name__ == "__main__":
    main()
