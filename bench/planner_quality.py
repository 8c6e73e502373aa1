"""Planner quality on real GPU types (catalog profiles): predicted throughput of the
`cephalo` plan against the `proportional` and `even` baselines and the ideal bound.

Everything here is a PREDICTION of one cost model (`cephalo.costmodel.model`) fed with the
published per-GPU measurements shipped in the catalog; nothing runs on a GPU. The ideal
bound comes from the same cost model:

    ideal = sum over devices i of  max_m  m / C_i(m)        samples/s (x seq_len: tokens/s)

where C_i(m) is the cost model's compute time (forward + recompute + backward of every
unit, LGA) of ONE micro-batch of m samples on device i, and m ranges over 1..min(B, 512)
such that device i's working memory at micro-batch m WITHOUT any training state and with
boundary activations offloaded fits its memory. It ignores collectives, the optimizer and
the memory of the state: no plan the cost model accepts can beat it (each rank's step
time is at least its compute, and its compute is at least b_i x its best per-sample time).
"""

from __future__ import annotations

import textwrap
import time
from dataclasses import dataclass

import numpy as np

from _common import Result, fmt_ratio, markdown_table, print_table, save_figure, verdict
from cephalo.costmodel.model import CostModel
from cephalo.costmodel.sources import catalog_cost_model
from cephalo.errors import PlanDoesNotFit
from cephalo.planner.makers import make_plan
from cephalo.planner.search.rank_tables import MAX_MICRO_BATCH
from cephalo.specs.catalog.models import get_model_spec
from cephalo.specs.cluster import Cluster

STRATEGIES = ("cephalo", "proportional", "even")


@dataclass
class Case:
    """One cluster / model / batch to plan."""

    label: str
    cluster: str
    model: str
    global_batch: int
    seq_len: int = 512
    dtype: str = "fp16"


CASES = [
    Case("paper: 2xL4+A6000+P40", "2xl4,a6000,p40", "gpt-2.7b", 64),
    Case("8xV100+8xA10G", "8xv100x16,8xa10g", "gpt-6.7b", 256),
    Case("16 GPUs, 5 types", "4xt4,4xl4,4xp40,2xv100x32,2xa6000", "gpt-2.7b", 256),
    Case("64 GPUs, 5 types", "16xt4,16xl4,16xa10g,8xa6000,8xa100x40", "llama-7b", 1024),
    Case("tight: llama-7b on 2xL4+A6000+P40", "2xl4,a6000,p40", "llama-7b", 32),
    Case("tight: llama-13b on 4xA6000+4xL4", "4xa6000,4xl4", "llama-13b", 64),
    Case("tight: llama-13b on 8xT4+4xA100-40G", "8xt4,4xa100x40", "llama-13b", 128),
]


def ideal_samples_per_s(cm: CostModel, global_batch: int) -> float:
    """The ideal bound of the module docstring (samples/s)."""
    total = 0.0
    ms = np.arange(1, min(global_batch, MAX_MICRO_BATCH) + 1)
    for rank, d in enumerate(cm.devices):
        cap = cm.capacity_bytes(rank)
        fits = cm.memory_without_state(d.type_key, cap, ms, ms, True) <= cap
        if not fits.any():
            continue  # this device cannot run even one sample: it adds no compute
        _, compute, _ = cm.step_time_parts(d.type_key, ms[fits], ms[fits], False)
        total += float(np.max(ms[fits] / compute))
    return total


def plan_case(case: Case) -> dict:
    cluster = Cluster.parse(case.cluster)
    cm = catalog_cost_model(cluster, get_model_spec(case.model), case.seq_len, case.dtype)
    row: dict = {"case": case, "tokens_per_s": {}, "plan_s": {}, "short": {}}
    for strategy in STRATEGIES:
        t0 = time.perf_counter()
        try:
            plan = make_plan(cm, case.global_batch, strategy)
            row["tokens_per_s"][strategy] = plan.predicted.tokens_per_s
        except PlanDoesNotFit as err:
            row["tokens_per_s"][strategy] = None
            row["short"][strategy] = max(err.shortfall_bytes.values(), default=0)
        row["plan_s"][strategy] = time.perf_counter() - t0
    row["ideal"] = ideal_samples_per_s(cm, case.global_batch) * case.seq_len
    return row


def main() -> None:
    started = time.perf_counter()
    rows = [plan_case(c) for c in CASES]

    headers = [
        "cluster",
        "model, batch",
        "cephalo tok/s",
        "proportional tok/s",
        "even tok/s",
        "ideal tok/s",
        "cephalo / ideal",
        "cephalo / even",
        "cephalo / prop.",
        "do not fit",
    ]
    table = []
    for r in rows:
        c, tp = r["case"], r["tokens_per_s"]

        def cell(s: str, tp=tp) -> str:
            return "does not fit" if tp[s] is None else f"{tp[s]:,.0f}"

        def ratio(a: str, b: str, tp=tp) -> str:
            return fmt_ratio(tp[a] / tp[b]) if tp[a] and tp[b] else "—"

        misfits = ", ".join(s for s in STRATEGIES if tp[s] is None) or "none"
        table.append(
            [
                f"{c.label} (`{c.cluster}`)",
                f"{c.model}, {c.global_batch}",
                *(cell(s) for s in STRATEGIES),
                f"{r['ideal']:,.0f}",
                fmt_ratio(tp["cephalo"] / r["ideal"]) if tp["cephalo"] else "—",
                ratio("cephalo", "even"),
                ratio("cephalo", "proportional"),
                misfits,
            ]
        )
    print_table("planner quality (predicted, catalog profiles)", headers, table)

    # cephalo should beat or match every baseline that fits, and fit whenever any does
    beats = all(
        r["tokens_per_s"]["cephalo"] is not None
        and all(
            r["tokens_per_s"][s] is None
            or r["tokens_per_s"]["cephalo"] >= r["tokens_per_s"][s] * (1 - 1e-9)
            for s in ("proportional", "even")
        )
        for r in rows
    )
    worst = min(
        r["tokens_per_s"]["cephalo"] / r["ideal"] for r in rows if r["tokens_per_s"]["cephalo"]
    )
    plan_times = max(max(r["plan_s"].values()) for r in rows)

    fig_name = _plot(rows)
    wall = time.perf_counter() - started
    result = Result(
        name="planner_quality",
        title="Planner quality: predicted throughput on real GPU types",
        predicted="Predictions of the cost model fed with the catalog's published per-GPU "
        "measurements (seq 512, fp16); no GPU was used.",
        summary=[
            markdown_table(headers, table, "llrrrrrrrl"),
            f"- `cephalo` fits every case and predicts at least the throughput of every baseline "
            f"that fits: {verdict(beats)}.\n"
            f"- Worst `cephalo / ideal`: {worst:.2f}. Slowest single planning call: {plan_times:.2f} s.",
        ],
        figures=[fig_name],
        details=[
            "## Method\n\n"
            "Each row plans the cluster with `make_plan(cost_model, global_batch, strategy)` for the "
            "three strategies; `tok/s` is the plan's predicted `tokens_per_s` "
            "(global batch x seq_len / predicted step time). `even`: equal batches and shards "
            "(plain FSDP). `proportional`: batches proportional to each device's speed, equal "
            "shards (earlier heterogeneous systems). Both pick the fewest micro-batches that fit "
            '(offloading activations only if needed). "does not fit": `PlanDoesNotFit`, '
            "even at micro-batch 1 with offloaded activations.\n\n"
            "**Ideal bound** = sum over devices of max_m m / C_i(m), with C_i(m) the cost "
            "model's compute time (forward + recompute + backward, all units) of one micro-batch "
            "of m samples on device i, over the micro-batches 1..min(B, 512) whose working memory "
            "(no training state, boundary activations offloaded) fits the device. It leaves out "
            "collectives, the optimizer and the state's memory, so no plan can exceed it under "
            "this cost model.",
        ],
    )
    result.write(wall)


def _plot(rows: list[dict]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [textwrap.fill(f"{r['case'].label} ({r['case'].model})", 18) for r in rows]
    series = [*STRATEGIES, "ideal"]
    colors = {
        "cephalo": "tab:blue",
        "proportional": "tab:orange",
        "even": "tab:gray",
        "ideal": "black",
    }
    x = np.arange(len(rows))
    width = 0.2
    fig, ax = plt.subplots(figsize=(12, 5.2))
    for k, s in enumerate(series):
        vals = []
        for r in rows:
            v = r["ideal"] if s == "ideal" else r["tokens_per_s"][s]
            vals.append(0.0 if v is None else v / r["ideal"])
        pos = x + (k - 1.5) * width
        bars = ax.bar(
            pos, vals, width, label=s, color=colors[s], alpha=0.35 if s == "ideal" else 1.0
        )
        for b, r in zip(bars, rows, strict=True):
            if s != "ideal" and r["tokens_per_s"][s] is None:
                ax.text(
                    b.get_x() + width / 2,
                    0.02,
                    "no fit",
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    color="tab:red",
                )
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("predicted throughput / ideal bound")
    ax.set_ylim(0, 1.1)
    ax.set_title("Planner quality (cost model + catalog profiles; predicted, not measured)")
    ax.legend(ncol=4, fontsize=8, loc="upper right")
    return save_figure(fig, "planner_quality", "predicted from published GPU profiles")


if __name__ == "__main__":
    main()
