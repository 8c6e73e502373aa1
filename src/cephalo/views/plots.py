"""Plots (matplotlib, Agg backend: files only, no display needed)."""

from __future__ import annotations

from pathlib import Path

from cephalo.errors import CephaloError
from cephalo.planning.costmodel import MEMORY_CATEGORIES, PlanEvaluation
from cephalo.planning.plan import Plan

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
