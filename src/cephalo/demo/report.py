"""The `cephalo demo` report: report.md and its PNGs, written from a `DemoResult`.

report.md        cluster, plans, predicted vs measured, losses, timings
loss.png         training and validation loss of the cephalo run
ranks.png        per rank: mean busy and idle seconds per step, for each measured run
throughput.png   measured samples/s per plan, the cost model's predictions, the ideal bound
plan.png         the cephalo plan per rank (batch, state, memory vs budget, busy time)
replan.png       step time per step of the re-planning run (throttling, re-plans marked)
"""

from __future__ import annotations

from pathlib import Path

from cephalo.costmodel.results import MEMORY_CATEGORIES
from cephalo.demo.result import (
    STRATEGIES,
    WARMUP_STEPS_EXCLUDED,
    DemoResult,
    RunSummary,
    describe_cluster,
)
from cephalo.demo.throttle import plot_throttle, throttle_markdown
from cephalo.planner.plan import Plan
from cephalo.runtime.step_timing import PARTS as TIME_PARTS
from cephalo.views.plots import pyplot

MIB = 2**20
COLORS = {"cephalo": "tab:green", "even": "tab:gray", "proportional": "tab:blue"}


# ----------------------------------------------------------------------------- plots
def plot_loss(run: RunSummary, path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), constrained_layout=True)
    steps = sorted(run.losses)
    ax.plot(steps, [run.losses[s] for s in steps], label="train (global batch)", color="tab:green")
    if run.val_losses:
        vs = sorted(run.val_losses)
        ax.plot(vs, [run.val_losses[s] for s in vs], "o--", label="validation", color="tab:red")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean token cross-entropy)")
    ax.set_title(f"cephalo plan: loss over {run.steps} steps")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ranks(result: DemoResult, path: Path) -> Path:
    """Per rank, mean busy (compute incl. emulated slowdown) and idle (waiting) seconds per step."""
    plt = pyplot()
    runs = list(result.runs.values())
    fig, axes = plt.subplots(
        1,
        len(runs),
        figsize=(5.5 * len(runs), 4),
        sharey=True,
        squeeze=False,
        constrained_layout=True,
    )
    labels = [
        f"{i}\n{d.type_key.replace('cpu:', '')}" for i, d in enumerate(result.cluster.devices)
    ]
    for ax, run in zip(axes[0], runs, strict=True):
        xs = range(len(run.busy_s))
        ax.bar(xs, run.busy_s, color=COLORS.get(run.strategy, "tab:green"), label="busy")
        ax.bar(
            xs, run.idle_s, bottom=run.busy_s, color="lightgray", hatch="//", label="idle (waiting)"
        )
        ax.axhline(
            run.mean_step_s,
            color="tab:red",
            linestyle="--",
            label=f"mean step {run.mean_step_s:.2f} s",
        )
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(f"{run.strategy} plan (measured)")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("seconds per step (mean)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput(result: DemoResult, path: Path) -> Path:
    """Measured bars, predicted markers, and the ideal (compute-only, perfectly balanced) bound."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4), constrained_layout=True)
    xs = list(range(len(STRATEGIES)))
    for x, s in zip(xs, STRATEGIES, strict=True):
        run = result.runs.get(s)
        if run is not None:
            ax.bar(
                x,
                run.samples_per_s,
                color=COLORS[s],
                alpha=0.8,
                label="measured" if x == 0 else None,
            )
            ax.text(
                x,
                run.samples_per_s,
                f"{run.samples_per_s:.1f}",
                ha="center",
                va="bottom",
                fontsize=9,
            )
        plan = result.plans[s]
        if isinstance(plan, Plan) and plan.predicted is not None:
            ax.plot(
                x,
                plan.predicted.samples_per_s,
                "k_",
                markersize=30,
                markeredgewidth=2,
                label="predicted" if s == "cephalo" else None,
            )
        else:
            ax.text(x, 0, "does not fit", ha="center", va="bottom", fontsize=9, color="tab:red")
    ax.axhline(
        result.ideal_samples_per_s,
        color="tab:purple",
        linestyle=":",
        label=f"ideal bound {result.ideal_samples_per_s:.1f}",
    )
    ax.set_xticks(xs)
    ax.set_xticklabels(STRATEGIES)
    ax.set_ylabel("samples / s")
    ax.set_title("throughput by plan (4 emulated devices)")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_plan_demo(result: DemoResult, path: Path) -> Path:
    """The cephalo plan per rank at the demo's scale (MiB): batch and micro-batches, state
    fraction, predicted memory by category (without the planner's safety reserve) vs the
    budget and the ledger's measured peak, predicted vs measured busy time."""

    plt = pyplot()
    plan = result.plans["cephalo"]
    assert isinstance(plan, Plan)
    ev = result.evaluations["cephalo"]
    run = result.runs.get("cephalo")
    labels = [f"{r.rank}\n{r.device.replace('cpu:', '')}" for r in plan.ranks]
    xs = list(range(len(plan.ranks)))
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    (ax_b, ax_s), (ax_m, ax_t) = axes
    ax_b.bar(xs, plan.batch_sizes, color="tab:blue")
    for x, r in zip(xs, plan.ranks, strict=True):
        if r.batch_size:
            ax_b.text(
                x,
                r.batch_size,
                r.micro_batches_text() + (" host" if r.offload_activations else ""),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax_b.set_title("batch (samples per step; micro-batches: size x count + the last)")
    ax_s.bar(xs, plan.state_fractions, color="tab:purple")
    ax_s.set_title("state fraction (share of weights, grads, Adam moments)")

    bottom = [0.0] * len(xs)
    for cat in MEMORY_CATEGORIES:
        if cat == "reserve":
            continue
        vals = [getattr(rc.memory, cat) / MIB for rc in ev.ranks]
        ax_m.bar(xs, vals, bottom=bottom, label=cat)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    top = max(bottom)
    if run is not None:
        measured = [b / MIB for b in run.peak_bytes]
        ax_m.scatter(xs, measured, marker="o", color="black", zorder=3, label="measured (ledger)")
        top = max(top, *measured)
    caps = [rc.capacity_bytes / MIB for rc in ev.ranks]
    limit = max(top * 1.3, min(caps) * 1.15)
    for x, cap in zip(xs, caps, strict=True):
        if cap <= limit:
            ax_m.hlines(cap, x - 0.4, x + 0.4, color="tab:red", linewidth=2.5)
            ax_m.text(
                x, cap, f"budget {cap:.0f}", ha="center", va="bottom", fontsize=8, color="tab:red"
            )
        else:
            ax_m.text(
                x,
                limit * 0.97,
                f"budget {cap:.0f}",
                ha="center",
                va="top",
                fontsize=8,
                color="tab:red",
            )
    ax_m.set_ylim(0, limit)
    ax_m.set_title("memory, MiB: predicted peak by category vs budget")
    ax_m.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.14))

    width = 0.38
    ax_t.bar(
        [x - width / 2 for x in xs],
        [rc.busy_s for rc in ev.ranks],
        width,
        color="tab:green",
        label="predicted (alone on the machine)",
    )
    if run is not None:
        ax_t.bar(
            [x + width / 2 for x in xs],
            run.busy_s,
            width,
            color="tab:olive",
            label="measured (shared cores)",
        )
    ax_t.set_title("busy seconds per step")
    ax_t.legend(fontsize=8)
    for ax in axes.flat:
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=8)
    pred = plan.predicted.samples_per_s if plan.predicted else 0.0
    fig.suptitle(
        f"cephalo plan: {plan.model}, batch {plan.global_batch_size}, seq {plan.seq_len}: "
        f"{pred:.3g} samples/s predicted"
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- markdown
def _plan_rows(result: DemoResult) -> list[str]:
    plan = result.plans["cephalo"]
    assert isinstance(plan, Plan)
    ev = result.evaluations["cephalo"]
    run = result.runs.get("cephalo")
    rows = [
        "| rank | device | memory | batch | micro-batches | state | activations | predicted busy s | "
        "predicted peak MiB (+ planner reserve) / budget | measured busy s | measured idle s | "
        "measured peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, (r, c) in enumerate(zip(plan.ranks, ev.ranks, strict=True)):
        d = result.cluster.devices[i]
        measured = (
            f"{run.busy_s[i]:.3f} | {run.idle_s[i]:.3f} | {run.peak_bytes[i] / MIB:.1f}"
            if run
            else "- | - | -"
        )
        rows.append(
            f"| {r.rank} | {r.device} | {d.memory_bytes / MIB:.0f} MiB | {r.batch_size} | "
            f"{r.micro_batches_text()} | {r.state_fraction:.3f} | "
            f"{'host' if r.offload_activations else 'device'} | {c.busy_s:.3f} | "
            f"{(c.peak_bytes - c.memory.reserve) / MIB:.1f} (+{c.memory.reserve / MIB:.0f}) / "
            f"{c.capacity_bytes / MIB:.0f} | {measured} |"
        )
    return rows


def _time_rows(result: DemoResult) -> list[str]:
    """Where a step's time goes on each rank of the cephalo run (runtime/step_timing.py)."""
    run = result.runs.get("cephalo")
    if run is None or not run.time_split:
        return []
    rows = [
        "## Where a step's time goes (cephalo run, mean per step)",
        "",
        "Compute: the units' passes (emulated slowdown included); communication: blocked in "
        "collectives; optimizer: the device AdamW phase; host: host-held state work; other: "
        "the engine's own Python work and the rest.",
        "",
        "| rank | " + " | ".join(f"{p} s" for p in TIME_PARTS) + " |",
        "|---|" + "---|" * len(TIME_PARTS),
    ]
    for i, split in enumerate(run.time_split):
        rows.append(f"| {i} | " + " | ".join(f"{split[p]:.3f}" for p in TIME_PARTS) + " |")
    return [*rows, ""]


def _strategy_rows(result: DemoResult) -> list[str]:

    even = result.plans["even"]
    even_pred = even.predicted.samples_per_s if isinstance(even, Plan) and even.predicted else None
    base = result.runs.get(result.comparison or "")
    rows = [
        "| plan | predicted step s | predicted samples/s | predicted vs even | measured step s | "
        "measured samples/s | measured vs " + (result.comparison or "baseline") + " |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in STRATEGIES:
        plan = result.plans[s]
        if not isinstance(plan, Plan) or plan.predicted is None:
            rows.append(f"| {s} | does not fit: {plan} | | | | | |")
            continue
        p = plan.predicted
        ratio = f"{p.samples_per_s / even_pred:.2f}x" if even_pred else "even does not fit"
        run = result.runs.get(s)
        if run is None:
            measured = "not run | | "
        else:
            speed = f"{run.samples_per_s / base.samples_per_s:.2f}x" if base else "-"
            measured = f"{run.step_s:.3f} | {run.samples_per_s:.2f} | {speed}"
        rows.append(f"| {s} | {p.step_s:.3f} | {p.samples_per_s:.2f} | {ratio} | {measured} |")
    return rows


def report_markdown(result: DemoResult, images: dict[str, str]) -> str:

    cfg = result.config
    ceph = result.runs["cephalo"]
    lines = [
        "# cephalo demo report",
        "",
        f"Four emulated devices on this machine's CPU ({describe_cluster(result.cluster)}), model "
        f"`{cfg.model.name}`, sequence length {cfg.data.seq_len}, global batch {cfg.train.global_batch_size}, "
        f"{cfg.model.dtype}, trained on the bundled pydoc corpus (byte-level tokens).",
        "",
        "> **The devices are emulated.** Every rank is a process on the same CPU. `slowdown=F` makes each "
        "piece of the rank's compute last F times its CPU time by sleeping after it; `mem=SIZE` is a budget "
        "enforced by the engine's memory ledger (an allocation over it fails, as an out-of-memory error would "
        "on a GPU); other devices have the default CPU budget. The ranks share the machine's cores: the "
        "profiles are measured with all ranks running at once, but the contention in training differs from "
        "plan to plan, so expect measured step times within 10-20% of the predictions; compare plans by "
        "their ratios.",
        "",
        "## Cluster",
        "",
        "| rank | device | slowdown | memory budget |",
        "|---|---|---|---|",
        *[
            f"| {i} | {d.type_key} | {d.slowdown:g} | {d.memory_bytes / MIB:.0f} MiB |"
            for i, d in enumerate(result.cluster.devices)
        ],
        "",
        "## Memory",
        "",
        result.memory_note,
        "",
        "## The cephalo plan",
        "",
        *_plan_rows(result),
        "",
        f"![plan]({images['plan']})",
        "",
        *_time_rows(result),
        "## Throughput: predicted and measured",
        "",
        *_strategy_rows(result),
        "",
        f"Ideal bound (every device at its best per-sample compute speed, no communication, no optimizer, "
        f"perfect balance): {result.ideal_samples_per_s:.2f} samples/s.",
        "",
    ]
    if result.comparison and result.comparison in result.runs:
        base = result.runs[result.comparison]
        lines += [
            f"**Measured speedup of the cephalo plan over the {result.comparison} plan: "
            f"{ceph.samples_per_s / base.samples_per_s:.2f}x** "
            f"({ceph.samples_per_s:.2f} vs {base.samples_per_s:.2f} samples/s; median step time without "
            f"the first {_excluded()} steps).",
            "",
        ]
    else:
        lines += [
            "Neither baseline plan fits in memory, so there is no baseline run to compare with.",
            "",
        ]
    lines += [
        f"![throughput]({images['throughput']})",
        "",
        f"![per-rank busy and idle time]({images['ranks']})",
        "",
    ]
    first, last = min(ceph.losses), max(ceph.losses)
    lines += [
        "## Training",
        "",
        f"{ceph.steps} steps under the cephalo plan: training loss {ceph.losses[first]:.3f} (step {first}) -> "
        f"{ceph.losses[last]:.3f} (step {last})"
        + (
            f", final validation loss {ceph.val_losses[max(ceph.val_losses)]:.3f}"
            if ceph.val_losses
            else ""
        )
        + ".",
        "",
        f"![loss]({images['loss']})",
        "",
        *(
            throttle_markdown(result.throttle, images["replan"])
            if result.throttle is not None
            else []
        ),
        "## Timings",
        "",
        "| phase | seconds |",
        "|---|---|",
        *[f"| {name} | {seconds:.1f} |" for name, seconds in result.timings_s.items()],
        "",
        "Training runs are timed from launch to exit (worker start-up, data, final checkpoint included). "
        "Profiles are cached: a second `cephalo demo` skips the measurements.",
        "",
        "## Files",
        "",
        f"- `plans/*.json`: the plans (`cephalo simulate plans/cephalo.json --profiles {result.config.profile_cache}`)",
        *[
            f"- `{name}/`: the {name} run (config.toml, plan.json, metrics.jsonl, checkpoints/); rerun it with "
            f"`cephalo run --config {result.options.out / (name + '.toml')}`"
            for name in result.runs
        ],
        *(
            [
                f"- `replan/`: the re-planning run (its metrics.jsonl has a `calibration` record per "
                f"calibration and a `replan` record per switch); rerun it with `cephalo run --config "
                f"{result.options.out / 'replan.toml'}`"
            ]
            if result.throttle is not None
            else []
        ),
        f"- `{Path(result.config.profile_cache).name}`: the profile database",
        "",
    ]
    return "\n".join(lines)


def _excluded() -> int:

    return WARMUP_STEPS_EXCLUDED


def write_report(result: DemoResult) -> Path:
    """report.md and the PNGs under `result.options.out`; returns the report's path."""
    out = result.options.out
    images = {
        "loss": "loss.png",
        "ranks": "ranks.png",
        "throughput": "throughput.png",
        "plan": "plan.png",
    }
    plot_loss(result.runs["cephalo"], out / images["loss"])
    plot_ranks(result, out / images["ranks"])
    plot_throughput(result, out / images["throughput"])
    plot_plan_demo(result, out / images["plan"])
    if result.throttle is not None:
        images["replan"] = "replan.png"
        plot_throttle(result.throttle, out / images["replan"])
    path = out / "report.md"
    path.write_text(report_markdown(result, images))
    return path
