"""The demo's re-planning run: a device throttles mid-run, and the job corrects its own plan.

    train under the job's own plan (parallel.plan = auto: the cached profiles, the same planner)
    -> from a step on (`throttle_schedule`) rank THROTTLE_RANK computes THROTTLE_SLOWDOWN x
       slower than its profile (parallel.emulate_drift: thermal throttling, a neighbour's job)
    -> calibration every few steps (train/calibration.py) finds its compute off the model
    -> the re-made plan is predicted faster; the next calibration, on fresh steps, confirms it
       (train/replan.py damping) -> every rank switches at a step boundary, without a restart
    -> report: per calibration, measured / predicted compute per rank, the predicted gain, the
       decision, old and new batches, re-plan + switch seconds; step time per step (replan.png)

Nothing here decides anything: the job calibrates and re-plans as any job with
`parallel.replan = own` does; this module configures the run and reads its metrics.jsonl back.
"""

from __future__ import annotations

import copy
from pathlib import Path

from rich.table import Table

from cephalo.demo.result import CalibrationEvent, ThrottleRun
from cephalo.specs.drift import DriftEntry, parse_drift
from cephalo.train.config import JobConfig
from cephalo.train.metrics import read_metrics
from cephalo.views.tables import calibration_table

THROTTLE_RANK = 0
"""The fast device (`cpu`, the largest batch): its throttling costs the most."""
THROTTLE_SLOWDOWN = 4.0
"""A quarter of its speed: slower than the demo's slowest devices (3x), so the plan must change."""


def throttle_schedule(quick: bool) -> tuple[int, int, int]:
    """(steps, the step the throttling starts, calibrate every): calibrations read disjoint
    windows of `calibrate every` steps, so the one after the window that starts with the
    throttling sees it and the next confirms it, leaving a window under the new plan."""
    return (12, 5, 2) if quick else (24, 9, 4)


def throttle_job_config(base: JobConfig, out: Path, quick: bool) -> JobConfig:
    """The demo's job (`base`, a copy is changed) as a re-planning run in `out`."""
    cfg = copy.deepcopy(base)
    steps, at, every = throttle_schedule(quick)
    cfg.profile.cache = str(base.profile_cache)  # the demo's profiles: planning is instant
    cfg.logging.dir = str(out)
    cfg.parallel.plan = "auto"  # the job's own plan: `replan = own` re-plans it
    cfg.parallel.replan = "own"
    cfg.parallel.calibrate_after = every
    cfg.parallel.calibrate_every = every
    cfg.parallel.emulate_drift = f"{at}:{THROTTLE_RANK}:{THROTTLE_SLOWDOWN:g}"
    cfg.train.steps = steps
    cfg.train.eval_every = 0  # this run is about step times and plans, not the loss
    return cfg


def read_throttle_run(cfg: JobConfig, wall_s: float) -> ThrottleRun:
    """The run's step times, calibrations and switches, from its metrics.jsonl."""
    path = cfg.metrics_path
    entry = _drift(cfg)
    run = ThrottleRun(Path(cfg.logging.dir), entry.rank, entry.step, entry.slowdown, wall_s)
    run.step_s = {int(r["step"]): float(r["step_s"]) for r in read_metrics(path, kind="step")}
    switches = {int(r["step"]): r for r in read_metrics(path, kind="replan")}
    for r in read_metrics(path, kind="calibration"):
        step = int(r["step"])
        decision = (
            "re-planned" if r["replanned"] else "confirming" if r.get("confirming") else "kept"
        )
        event = CalibrationEvent(
            step=step,
            predicted_compute_s=[float(f["predicted_compute_s"]) for f in r["ranks"]],
            measured_compute_s=[float(f["measured_compute_s"]) for f in r["ranks"]],
            predicted_gain=r.get("predicted_gain"),
            decision=decision,
            why_not=r.get("why_not") or "",
            batches=list(r.get("batches") or []),
            micro_batches=list(r.get("micro_batches") or []),
        )
        switch = switches.get(step)
        if r["replanned"] and switch is not None:
            event.new_batches = list(switch["batches"])
            event.new_micro_batches = list(switch["micro_batches"])
            event.replan_s, event.switch_s = float(switch["replan_s"]), float(switch["seconds"])
            event.staged = list(switch.get("staged") or [])
        run.events.append(event)
    return run


def _drift(cfg: JobConfig) -> DriftEntry:
    return parse_drift(cfg.parallel.emulate_drift)[0]


# ----------------------------------------------------------------------------- rendering
def _ratios(e: CalibrationEvent) -> str:
    return " ".join("-" if x is None else f"{x:.2f}" for x in e.ratios())


def _gain(e: CalibrationEvent) -> str:
    return "-" if e.predicted_gain is None else f"{e.predicted_gain:+.1%}"


def _batches(e: CalibrationEvent) -> str:
    if e.new_batches is None:
        return str(e.batches)
    if e.new_batches == e.batches:  # the same split, run in other micro-batches
        return f"{e.batches}, micro-batches {e.micro_batches} -> {e.new_micro_batches}"
    return f"{e.batches} -> {e.new_batches}"


def _seconds(e: CalibrationEvent) -> str:
    if e.replan_s is None or e.switch_s is None:
        return "-"
    ranks = "rank" if len(e.staged) == 1 else "ranks"
    staged = f" (staged: {ranks} {', '.join(map(str, e.staged))})" if e.staged else ""
    return f"{e.replan_s:.2f} + {e.switch_s:.2f}{staged}"


def _row(e: CalibrationEvent) -> list[str]:
    """A calibration's cells, as the console table and the report show them."""
    return [str(e.step), _ratios(e), _gain(e), e.decision, _batches(e), _seconds(e)]


def throttle_table(run: ThrottleRun) -> Table:
    """One row per calibration (console)."""
    title = f"calibrations (rank {run.rank} throttled {run.slowdown:g}x from step {run.at_step})"
    return calibration_table(title, [_row(e) for e in run.events])


def throttle_summary(run: ThrottleRun) -> str:
    """Measured step times before the throttling, throttled on the old plan, after the switch
    that answered it (the first at or after the throttling: a loaded machine can make the job
    re-plan before it too, which the summary says, not counts)."""
    before = run.median_step_s(2, run.at_step - 1)  # step 1 warms up
    answered = [e.step for e in run.switches if e.step >= run.at_step]
    earlier = [e.step for e in run.switches if e.step < run.at_step]
    also = (
        f"; it also re-planned after step {', '.join(map(str, earlier))}, before the throttling"
        if earlier
        else ""
    )
    if not answered:
        throttled = run.median_step_s(run.at_step, max(run.step_s, default=0))
        return (
            f"no re-plan after the throttling in this run (measured step {_s(before)} before it, "
            f"{_s(throttled)} after){also}: see the calibrations' decisions"
        )
    first = answered[0]
    throttled = run.median_step_s(run.at_step, first)
    after = run.median_step_s(first + 2, max(run.step_s))  # the new plan's first step warms up
    return (
        f"measured step {_s(before)} before the throttling, {_s(throttled)} throttled under the "
        f"old plan, {_s(after)} after the re-plan (switched after step {first}, no restart){also}"
    )


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def throttle_markdown(run: ThrottleRun, image: str) -> list[str]:
    """The report's section on the re-planning run."""
    rows = [
        "## The plan corrects itself: a device throttles mid-run",
        "",
        f"A third run trains the same job under its own plan (`parallel.plan = auto`, "
        f"`parallel.replan = own`) with rank {run.rank} computing {run.slowdown:g}x slower than "
        f"its profile from step {run.at_step} on (`parallel.emulate_drift = "
        f'"{run.at_step}:{run.rank}:{run.slowdown:g}"`: a GPU that throttles). Every few steps the '
        "job refits its cost model to its own measurements and re-plans; a switch needs two "
        "calibrations in a row, on different steps, to predict the new plan faster "
        "(docs/calibration.md).",
        "",
        "| after step | measured / predicted compute, per rank | predicted gain | decision | "
        "batches | re-plan + switch s |",
        "|---|---|---|---|---|---|",
    ]
    rows += ["| " + " | ".join(_row(e)) + " |" for e in run.events]
    rows += [
        "",
        "Measured / predicted compute: the median over the steps the calibration read, against "
        "the cost model as the previous calibration left it (1.00: the model is right). The "
        "predicted gain: the re-made plan's step against the running plan's, both predicted by "
        "the refitted model; a switch needs it at least `parallel.replan_min_gain` (3 %) at two "
        "calibrations in a row. Staged: the ranks whose device could not hold the new engine "
        "beside the old one, so their state waited in host memory while the engine was rebuilt "
        "(`parallel.replan_staging`).",
        "",
        throttle_summary(run) + ".",
        "",
        f"![step time per step of the re-planning run]({image})",
        "",
    ]
    return rows


def plot_throttle(run: ThrottleRun, path: Path) -> Path:
    """Measured step time per step, the throttling and the switches marked."""
    from cephalo.views.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5), constrained_layout=True)
    steps = sorted(run.step_s)
    ax.plot(steps, [run.step_s[s] for s in steps], "o-", color="tab:green", markersize=3)
    ax.axvline(run.at_step - 0.5, color="tab:red", linestyle="--", label="rank throttles")
    for i, e in enumerate(run.switches):
        ax.axvline(
            e.step + 0.5, color="tab:blue", linestyle=":", label="re-planned" if i == 0 else None
        )
    confirming = [e for e in run.events if e.decision == "confirming"]
    for i, e in enumerate(confirming):
        label = "a gain seen, to confirm" if i == 0 else None
        ax.axvline(e.step + 0.5, color="tab:orange", linestyle=":", alpha=0.6, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (s)")
    ax.set_title(f"rank {run.rank} {run.slowdown:g}x slower from step {run.at_step}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
