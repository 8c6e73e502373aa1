"""Plots (matplotlib, Agg backend: files only, no display needed)."""

from __future__ import annotations

from pathlib import Path

from cephalo.advise.results import Advice
from cephalo.costmodel.results import MEMORY_CATEGORIES, PlanEvaluation
from cephalo.errors import CephaloError
from cephalo.planner.plan import Plan

GIB = 1024**3


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported on first use: it is slow to import)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_plan(
    plan: Plan, evaluation: PlanEvaluation, path: str | Path, title: str | None = None
) -> Path:
    """Per rank: batch, state fraction, memory used (by category) vs capacity, and busy time."""
    plt = pyplot()
    path = Path(path)
    if path.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise CephaloError(f"plot file {path} must end in .png, .pdf or .svg")
    labels = [f"{r.rank}\n{r.device}" for r in plan.ranks]
    xs = range(len(plan.ranks))
    fig, axes = plt.subplots(
        2, 2, figsize=(max(10.0, 0.5 * len(labels) + 6), 7.5), constrained_layout=True
    )
    (ax_b, ax_s), (ax_m, ax_t) = axes

    ax_b.bar(xs, plan.batch_sizes, color="tab:blue")
    ax_b.set_title("batch (samples per step)")
    ax_s.bar(xs, plan.state_fractions, color="tab:purple")
    ax_s.set_title("state fraction (share of the sharded state)")

    bottom = [0.0] * len(plan.ranks)
    for cat in MEMORY_CATEGORIES:
        vals = [getattr(rc.memory, cat) / GIB for rc in evaluation.ranks]
        ax_m.bar(xs, vals, bottom=bottom, label=cat)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax_m.scatter(
        xs,
        [rc.capacity_bytes / GIB for rc in evaluation.ranks],
        marker="_",
        s=600,
        color="black",
        label="capacity",
        zorder=3,
    )
    ax_m.set_title("memory, GiB: predicted peak vs capacity")
    ax_m.legend(fontsize=6, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.12))

    compute = [rc.compute_s for rc in evaluation.ranks]
    optim = [rc.optimizer_s for rc in evaluation.ranks]
    ax_t.bar(xs, compute, label="forward + recompute + backward", color="tab:green")
    ax_t.bar(xs, optim, bottom=compute, label="optimizer", color="tab:olive")
    ax_t.axhline(
        evaluation.step_s, color="tab:red", linestyle="--", label=f"step {evaluation.step_s:.3g} s"
    )
    ax_t.set_title("busy time per step (s)")
    ax_t.legend(fontsize=7)

    for ax in axes.flat:
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=7 if len(labels) > 8 else 9)
    fig.suptitle(
        title
        or f"{plan.strategy} plan: {plan.model}, batch {plan.global_batch_size}, seq {plan.seq_len}, "
        f"{plan.dtype}: {evaluation.samples_per_s:.3g} samples/s"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_advice(advice: Advice, path: str | Path) -> Path:
    """Left: the frontier (price per hour vs tokens/s), the budget, the target and the chosen
    cluster. Right: what each device of the chosen (and owned) cluster is worth, and what one
    more unit of each offer would add."""
    plt = pyplot()
    path = Path(path)
    if path.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise CephaloError(f"plot file {path} must end in .png, .pdf or .svg")
    fig, (ax_f, ax_m) = plt.subplots(1, 2, figsize=(13, 5.2), constrained_layout=True)
    prices = [p.price_per_hour for p in advice.frontier]
    tokens = [p.tokens_per_s for p in advice.frontier]
    ax_f.step(prices, tokens, where="post", color="tab:blue", alpha=0.5)
    ax_f.plot(
        prices, tokens, "o", color="tab:blue", markersize=3, label="frontier (planner's throughput)"
    )
    if advice.budget is not None:
        ax_f.axvline(
            advice.budget,
            color="tab:orange",
            linestyle="--",
            label=f"budget ${advice.budget:,.2f}/h",
        )
    if advice.target_tokens_per_s is not None:
        ax_f.axhline(
            advice.target_tokens_per_s,
            color="tab:green",
            linestyle="--",
            label=f"target {advice.target_tokens_per_s:,.0f} tokens/s",
        )
    if advice.chosen is not None:
        c = advice.chosen
        ax_f.plot(
            [c.price_per_hour],
            [c.tokens_per_s],
            "*",
            color="tab:red",
            markersize=16,
            label=f"chosen: {advice.chosen_why}",
        )
        ax_f.annotate(
            " + ".join(f"{n}x {name}" for name, n in c.counts.items()),
            (c.price_per_hour, c.tokens_per_s),
            textcoords="offset points",
            xytext=(8, -14),
            fontsize=8,
        )
    bound = advice.search.bound
    ax_f.set_title(
        f"{advice.model}, global batch {advice.global_batch}, seq {advice.seq_len}, {advice.dtype}"
        + ("" if bound.exact else f" (within {100 * bound.tolerance:.2g}%)")
    )
    ax_f.set_xlabel("price, USD per hour")
    ax_f.set_ylabel("tokens/s")
    ax_f.grid(True, alpha=0.3)
    ax_f.legend(fontsize=8, loc="lower right")

    labels, values, colors = [], [], []
    for m in advice.marginal:
        who = "chosen" if m.base == "chosen" else "have"
        for d in m.devices:
            labels.append(f"{who}: -1 {d.offer or d.type}")
            values.append(-d.tokens_per_s_lost)
            colors.append(
                {True: "tab:green", False: "tab:red", None: "tab:gray"}[d.pays_for_itself]
            )
        best = m.best_to_add
        for a in m.additions:
            labels.append(f"{who}: +{a.gpus} {a.offer}")
            values.append(a.tokens_per_s_gained)
            colors.append("tab:blue" if a is best else "lightsteelblue")
    ys = range(len(labels))
    ax_m.barh(list(ys), values, color=colors)
    ax_m.set_yticks(list(ys))
    ax_m.set_yticklabels(labels, fontsize=7 if len(labels) > 14 else 9)
    ax_m.invert_yaxis()
    ax_m.axvline(0, color="black", linewidth=0.8)
    ax_m.set_xlabel(
        "tokens/s: lost without one device (green: pays for itself, red: does not) / gained with one more unit (dark: best to add)"
    )
    ax_m.xaxis.label.set_fontsize(8)
    ax_m.set_title("marginal value of each device")
    ax_m.grid(True, axis="x", alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
