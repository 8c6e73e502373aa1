"""Calibration and re-planning while training (issue #25), on an emulated cluster.

    python bench/calibration.py [--steps 20] [--change 8] [--only drift|cluster-b]

EMULATED: two local gloo ranks on this CPU stand in for a fast and a 2x slower device
(`cpu:slowdown=3`, `cpu:slowdown=6`: slowdowns well above 1 so that the emulated speeds, not
the other jobs sharing this machine's cores, decide each rank's time). At step `--change` the
fast device becomes 4x slower (slowdown 12)
(`CEPHALO_EMULATE_DRIFT`, runtime/emulation.py: thermal throttling, a neighbour's job), so
its profile is wrong from then on. Three jobs, side by side in one run, each `train(cfg)`
on the same ranks (`parallel.plan = auto`, one shared profile database):

- **calibrated**: the drifting cluster, `parallel.replan = own`, calibrating every
  `CAL_EVERY` steps: it sees the change, re-plans and switches without a restart;
- **not calibrated**: the same with `parallel.replan = off` (the plan made at the start);
- **true profile**: the cluster as it is after the change (`cpu:slowdown=12,cpu:slowdown=6`),
  profiled and planned so from the start, `replan = off`: the reference.

Targets: within 10 steps of the change the calibrated run's throughput (median step over the
last `TAIL` steps of those 10) reaches >= 0.95x the true-profile run's over the same steps;
after calibration the predicted step (the calibrated cost model's, before the last refit)
is within 5 % of the measured one on every rank; a re-plan + switch takes < 2 s.

CLUSTER B (`--only cluster-b` runs this section alone): cluster B of hetero_throughput.py,
`cpu:mem=44MiB,cpu:slowdown=2:mem=64MiB` (speeds 2:1, both short of memory, the budgets
enforced by the engine's ledger), global batch 48, its model (gpt-small-demo, n_layer 4,
untied embeddings, no dropout) and its profile settings, on the same two ranks as above.
Side by side in one run, each `train(cfg)` with `parallel.plan = auto` from the same profiles:

- **not calibrated**: the plan the job makes itself from its profiles, `replan = off`;
- **calibrated**: the same with `replan = own`, calibrating every `CAL_EVERY` steps;
- **ideal**: hetero_throughput.py's bound, by its code (`_systems.SoloTrainer`,
  `ideal_tokens_per_s`): every rank trains alone (world size 1, no collectives) at the largest
  micro-batch up to 8 whose working memory fits its `mem=`, all ranks at once, per round the
  sum of their samples per compute second; measured in rounds before and after the two jobs
  (the machine's load moves) and the median round taken.

Throughput: the median step over the steps after calibration settles (from the second step
after the calibrated job's last switch, or after its second calibration if it never switches,
to the end), the same steps for both jobs. Target (issue #25): calibrated >= 0.9 x ideal
(the ideal of the solo phases either side of the calibrated job).

The bound cannot be rotated step by step with the jobs as in hetero_throughput.py (each job is
a whole `train(cfg)`), so it is measured minutes apart from the steps it bounds. On a quiet
machine that is fine (solo rounds within 2 % of each other); with other jobs on the cores the
solo rounds move by 2x within a minute and a job can come out faster than its bound: a job
above `BOUND_SLACK` x its bound makes the verdict inconclusive. Under such load the emulated
2:1 is also about 1:1 (`slowdown` stretches thread CPU time; the fast rank's wall time is
stretched by the sharing itself), so profiles, plans and ratios differ run to run
(docs/calibration.md, "Measured: cluster B"). Per rank, the section shows compute speed under
the plan against solo speed and the wait in collectives: where a job falls short of the bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from _common import (
    RankPool,
    Result,
    markdown_table,
    print_table,
    raise_priority,
    save_figure,
    verdict,
)
from _systems import ideal_tokens_per_s
from cephalo import envvars
from cephalo.envvars import scoped_environ
from cephalo.planner.plan import Plan
from cephalo.train.config import JobConfig
from cephalo.train.config_manager import load_config
from cephalo.train.trainer import train
from hetero_throughput import CASES, profile_cluster
from hetero_throughput import model_overrides as hetero_overrides

MODEL = "gpt-small-demo"
SEQ_LEN = 128
BATCH = 16
DECLARED = "cpu:slowdown=3,cpu:slowdown=6"
TRUE = "cpu:slowdown=12,cpu:slowdown=6"
DRIFT_RANK, DRIFT_SLOWDOWN = 0, 12
CAL_EVERY = 3
"""Calibrate every 3 steps (and confirm a gain 3 steps later, train/replan.py's damping): a
change at step 8 is seen after step 9 (steps 7-9, two of them changed) and confirmed after 12,
so the throughput window (steps 16-18) runs the new plan. At 4 (this bench's value before the
damping) the switch would come after step 16, inside that window."""
TAIL = 3


def _config(
    run_dir: Path,
    devices: str,
    replan: str,
    steps: int,
    profiles: Path,
    batch: int = BATCH,
    extra: Sequence[str] = (),
) -> JobConfig:
    return load_config(
        None,
        [
            f"--logging.dir={run_dir}",
            "--logging.progress=false",
            "--logging.log_every=1",
            f"--model.name={MODEL}",
            f"--data.seq_len={SEQ_LEN}",
            f"--train.global_batch_size={batch}",
            f"--train.steps={steps}",
            "--train.eval_every=0",
            "--parallel.plan=auto",
            f"--parallel.devices={devices}",
            f"--parallel.replan={replan}",
            f"--parallel.calibrate_after={CAL_EVERY}",
            f"--parallel.calibrate_every={CAL_EVERY}",
            "--checkpoint.every=0",
            f"--profile.cache={profiles}",
            "--profile.repeats=2",
            *extra,
        ],
    )


def _train(cfg: JobConfig, env: dict[str, str]) -> list[dict]:
    with scoped_environ(env):
        result = train(cfg)
    return result.replans


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@dataclass
class Section:
    """One section's part of the results file."""

    summary: list[str]
    details: list[str]
    figures: list[str]
    emulated: str


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="steps of the drift section's jobs")
    ap.add_argument("--change", type=int, default=8, help="step from which the device drifts")
    ap.add_argument("--b-steps", type=int, default=21, help="steps of the cluster-B section's jobs")
    ap.add_argument("--only", choices=SECTIONS, default=None, help="run one section alone")
    args = ap.parse_args()
    raise_priority()
    started = time.perf_counter()
    sections = [args.only] if args.only else list(SECTIONS)
    done: list[Section] = []
    with tempfile.TemporaryDirectory() as tmp, RankPool(2, timeout_s=900) as pool:
        for name in sections:
            done.append(SECTIONS[name](args, pool, Path(tmp) / name))
    Result(
        # a section run alone gets its own file, so the full run's results stay as they were
        "calibration" if args.only is None else f"calibration_{args.only.replace('-', '_')}",
        "Calibration and re-planning while training",
        emulated="; ".join(d.emulated for d in done),
        summary=[b for d in done for b in d.summary],
        details=[b for d in done for b in d.details] + ["## Method", __doc__.split("\n\n", 2)[2]],
        figures=[f for d in done for f in d.figures],
    ).write(time.perf_counter() - started)


def _drift(args: argparse.Namespace, pool, tmp: Path) -> Section:
    """The drift section: a device slows down mid-run (the module docstring)."""
    tmp.mkdir(parents=True)
    drift = {envvars.EMULATE_DRIFT: f"{args.change}:{DRIFT_RANK}:{DRIFT_SLOWDOWN}"}
    jobs = {
        "calibrated": (DECLARED, "own", drift),
        "not calibrated": (DECLARED, "off", drift),
        "true profile": (TRUE, "off", {}),
    }
    runs: dict[str, list[dict]] = {}
    profiles = tmp / "profiles.json"
    for name, (devices, replan, env) in jobs.items():
        run_dir = tmp / name.replace(" ", "-")
        print(f"{name}: {devices}, replan = {replan}, {env or 'no drift'}", flush=True)
        pool.run(_train, _config(run_dir, devices, replan, args.steps, profiles), env)
        runs[name] = _records(run_dir)

    def steps_of(name: str) -> dict[int, float]:
        return {r["step"]: r["step_s"] for r in runs[name] if r.get("kind") == "step"}

    window = list(range(args.change + 10 - TAIL + 1, args.change + 11))
    window = [s for s in window if s <= args.steps]
    tail = {name: statistics.median(steps_of(name)[s] for s in window) for name in jobs}
    ratio = {name: tail["true profile"] / tail[name] for name in jobs}
    tokens = {name: BATCH * SEQ_LEN / tail[name] for name in jobs}
    rows = [
        [name, f"{tail[name]:.3f}", f"{tokens[name]:.0f}", f"{ratio[name]:.2f}"] for name in jobs
    ]
    headers = [
        "job",
        f"median step, steps {window[0]}-{window[-1]} (s)",
        "tokens/s",
        "x true profile",
    ]
    print_table("throughput after the change", headers, rows)

    switches = [r for r in runs["calibrated"] if r.get("kind") == "replan"]
    cals = [r for r in runs["calibrated"] if r.get("kind") == "calibration"]
    switch_rows = [
        [
            r["step"],
            r["batches"],
            r["micro_batches"],
            f"{r['replan_s']:.2f}",
            f"{r['seconds']:.2f}",
            f"{r['predicted_gain']:.1%}" if r["predicted_gain"] is not None else "—",
        ]
        for r in switches
    ]
    switch_headers = [
        "after step",
        "batches",
        "micro-batches",
        "re-plan (s)",
        "switch (s)",
        "predicted gain",
    ]
    print_table("re-plans of the calibrated job", switch_headers, switch_rows)
    # the last calibration: the model calibrated before it against the steps since
    last = cals[-1]
    plan_pred = max(f["predicted_step_s"] for f in last["ranks"])
    pred_rows, pred_errors = [], []
    for f in last["ranks"]:
        err = plan_pred / f["measured_step_s"] - 1
        pred_errors.append(abs(err))
        pred_rows.append(
            [
                f["rank"],
                f["device"],
                f"{plan_pred:.3f}",
                f"{f['measured_step_s']:.3f}",
                f"{err:+.1%}",
            ]
        )
    pred_headers = [
        "rank",
        "device (profiled as)",
        "predicted step (s)",
        "measured step (s)",
        "error",
    ]
    print_table(f"prediction after calibration (step {last['step']})", pred_headers, pred_rows)

    in_time = [r for r in switches if args.change <= r["step"] < args.change + 10]
    ok_throughput = ratio["calibrated"] >= 0.95 and bool(in_time)
    ok_prediction = max(pred_errors) <= 0.05
    ok_time = all(r["replan_s"] + r["seconds"] < 2.0 for r in switches) and bool(switches)
    summary = [
        "## A device slows down mid-run",
        markdown_table(headers, rows),
        f"- calibrated >= 0.95x the true-profile plan within 10 steps of the change: "
        f"{ratio['calibrated']:.2f}x, re-planned after step(s) {[r['step'] for r in switches]} "
        f"(change at step {args.change}): {verdict(ok_throughput)}",
        f"- predicted step within 5 % of measured on every rank after calibration: worst "
        f"{max(pred_errors):.1%}: {verdict(ok_prediction)}",
        f"- re-plan + switch < 2 s: worst "
        f"{max((r['replan_s'] + r['seconds'] for r in switches), default=float('nan')):.2f} s: "
        f"{verdict(ok_time)}",
    ]
    details = [
        "## Drift: re-plans of the calibrated job",
        markdown_table(switch_headers, switch_rows),
        f"## Drift: prediction after calibration (step {last['step']})",
        "The plan's predicted step (the slowest rank's, as a synchronous step ends together) by "
        "the cost model as calibrated before this calibration, against each rank's median "
        "measured step since.",
        markdown_table(pred_headers, pred_rows),
    ]
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name in jobs:
        s = steps_of(name)
        xs = sorted(k for k in s if k > 1)
        ax.plot(xs, [BATCH * SEQ_LEN / s[k] for k in xs], marker=".", label=name)
    ax.axvline(args.change - 0.5, color="0.5", ls="--", lw=1)
    for r in switches:
        ax.axvline(r["step"] + 0.5, color="tab:blue", ls=":", lw=1)
    ax.set_xlabel("step (dashed: device slows down; dotted: re-plan)")
    ax.set_ylabel("tokens/s")
    ax.legend()
    fig_name = save_figure(fig, "calibration", note="emulated")
    return Section(
        summary,
        details,
        [fig_name],
        f"two CPU ranks ({DECLARED}); rank {DRIFT_RANK} runs at slowdown {DRIFT_SLOWDOWN} "
        f"from step {args.change}",
    )


# ====================================================================== cluster B
B_CASE = next(c for c in CASES if c.label.startswith("B"))
B_N_LAYER = 4
"""hetero_throughput.py's default model depth."""
B_TAIL_MIN = 4
"""Fewest settled steps the throughput is read over (else the verdict says so)."""
IDEAL_ROUNDS = 5
"""Solo rounds in each phase (before, between and after the two jobs)."""
IDEAL_WARMUP = 2
"""Solo rounds not read in each phase: a fresh engine's first steps run slow (allocator,
first touches), up to 1.4x in a first run with one warm-up round."""
BOUND_SLACK = 1.05
"""A job measured this much above the ideal next to it means the bound was measured under
another load than the job (the bound holds for the same machine): the verdict is then
inconclusive, not met."""


def _b_extra() -> list[str]:
    """hetero_throughput.py's model and profile settings as config overrides, so that the
    job plans from the profiles that bench plans from."""
    ov = ",".join(f"{k}={str(v).lower()}" for k, v in hetero_overrides(B_N_LAYER).items())
    return [
        f"--model.overrides={ov}",
        "--profile.warmup=1",
        "--profile.time_cap_s=6.0",
        "--profile.max_micro_batch=8",
        "--profile.per_sample_dropout=false",
    ]


def _solo_rounds(spec: str, cache: str, rounds: int) -> dict:
    """Runs on every rank: hetero_throughput.py's ideal-bound term for this rank, `rounds`
    solo steps (after `IDEAL_WARMUP`), all ranks at once."""
    import torch.distributed as dist

    from _systems import SoloTrainer, make_data

    cluster, cm, _, _ = profile_cluster(spec, B_N_LAYER, cache)
    solo = SoloTrainer(
        MODEL, hetero_overrides(B_N_LAYER), SEQ_LEN, cm, cluster.devices[dist.get_rank()]
    )
    x, y = make_data(solo.batch, SEQ_LEN, 256)
    rates = []
    for _ in range(IDEAL_WARMUP + rounds):
        dist.barrier()
        rates.append(solo.samples_per_s(x, y))
    return {"rates": rates[IDEAL_WARMUP:], "micro_batch": solo.micro_batch}


def _plan_text(plan: Plan) -> str:
    """A plan in one line, as hetero_throughput.py's plan table writes it."""
    return "; ".join(
        f"b={r.batch_size} m={r.micro_batch_size} s={r.state_fraction:.2f}"
        + (" off" if r.offload_activations else "")
        + (f" host={r.host_state_fraction:.2f}" if r.host_state_fraction else "")
        + ("" if r.overlap_reduce else " wait")
        for r in plan.ranks
    )


def _cluster_b(args: argparse.Namespace, pool, tmp: Path) -> Section:
    """Cluster B of hetero_throughput.py: plain plan, calibrated plan and ideal bound."""
    tmp.mkdir(parents=True)
    spec, batch = B_CASE.spec, B_CASE.global_batch
    profiles = tmp / "profiles.json"
    jobs = {"not calibrated": "off", "calibrated": "own"}
    runs: dict[str, list[dict]] = {}
    plans: dict[str, Plan] = {}
    # solo phases before, between and after the jobs: this machine's load moves by tens of
    # per cent within minutes, so each job is held against the ideal measured next to it
    solo: list[list[dict]] = []

    def solo_phase() -> None:
        print(f"cluster B ({spec}): ideal, {IDEAL_ROUNDS} solo rounds", flush=True)
        solo.append(pool.run(_solo_rounds, spec, str(profiles), IDEAL_ROUNDS))

    solo_phase()
    for name, replan in jobs.items():
        run_dir = tmp / name.replace(" ", "-")
        print(f"cluster B: {name}, replan = {replan}", flush=True)
        cfg = _config(run_dir, spec, replan, args.b_steps, profiles, batch, _b_extra())
        pool.run(_train, cfg, {})
        runs[name] = _records(run_dir)
        # the plan the job ran last (plan.json: rank 0 rewrites it at every switch)
        plans[name] = Plan.from_json(run_dir / "plan.json")
        solo_phase()
    world = len(solo[0])

    def solo_rates(phases: Sequence[int]) -> list[list[float]]:
        """Per rank, its solo samples/s over the rounds of these phases."""
        return [[v for k in phases for v in solo[k][r]["rates"]] for r in range(world)]

    # each job against the phases either side of it; the overall bound over all phases
    near = {name: solo_rates([k, k + 1]) for k, name in enumerate(jobs)}
    ideal_near = {name: ideal_tokens_per_s(near[name], SEQ_LEN) for name in jobs}
    ideal = ideal_tokens_per_s(solo_rates(range(len(solo))), SEQ_LEN)

    def steps_of(name: str) -> dict[int, float]:
        return {r["step"]: r["step_s"] for r in runs[name] if r.get("kind") == "step"}

    switches = [r for r in runs["calibrated"] if r.get("kind") == "replan"]
    cals = [r for r in runs["calibrated"] if r.get("kind") == "calibration"]
    # settled: the first step under the last plan warms up (never read by calibration either)
    settle = switches[-1]["step"] + 2 if switches else 2 * CAL_EVERY + 1
    window = list(range(settle, args.b_steps + 1))
    tok = {
        name: batch * SEQ_LEN / statistics.median(steps_of(name)[s] for s in window)
        for name in jobs
    }
    frac = tok["calibrated"] / ideal_near["calibrated"]
    ok = frac >= 0.9 and len(window) >= B_TAIL_MIN
    bound_held = all(tok[name] <= BOUND_SLACK * ideal_near[name] for name in jobs)
    outcome = (
        verdict(ok)
        if bound_held
        else "**inconclusive** (a job ran faster than the ideal bound measured next to it: "
        "the machine's load moved between the two)"
    )
    # The quiet-machine view: other jobs on this machine's cores only ever slow a step or a
    # solo round down, so the fastest settled step against the fastest solo round of each
    # rank next to it compares the two where the load was least (not the verdict: the target
    # is stated on medians, as hetero_throughput.py measures it)
    quiet = {
        name: batch
        * SEQ_LEN
        / min(steps_of(name)[s] for s in window)
        / (sum(max(rates) for rates in near[name]) * SEQ_LEN)
        for name in jobs
    }
    headers = [
        "job",
        f"tokens/s, steps {window[0]}-{window[-1]} (median step)",
        "ideal next to it (tokens/s)",
        "x ideal",
        "plan at the end (per rank: batch, micro-batch, state fraction, off = offloaded "
        "activations, host = host state fraction, wait = no reduce overlap)",
    ]
    rows = [
        [
            name,
            f"{tok[name]:,.0f}",
            f"{ideal_near[name]:,.0f}",
            f"**{tok[name] / ideal_near[name]:.2f}**",
            _plan_text(plans[name]),
        ]
        for name in jobs
    ]
    rows.append(
        [
            "ideal (solo ranks, summed), all phases",
            f"{ideal:,.0f}",
            "",
            "",
            "solo micro-batch " + " / ".join(str(r["micro_batch"]) for r in solo[0]),
        ]
    )
    # where a job loses against the bound: each rank's compute speed under its plan (samples
    # per compute second) against its solo speed next to the job, and what it waits
    rank_headers = [
        "job",
        "rank",
        "batch",
        "compute s",
        "comm wait s",
        "compute samples/s",
        "solo samples/s (next to it)",
        "x solo",
    ]
    rank_rows = []
    for name in jobs:
        recs = [r for r in runs[name] if r.get("kind") == "step" and r["step"] in window]
        for r, rp in enumerate(plans[name].ranks):
            busy = statistics.median(x["ranks"]["busy_s"][r] for x in recs)
            wait = statistics.median(x["ranks"]["comm_wait_s"][r] for x in recs)
            solo_r = statistics.median(near[name][r])
            rank_rows.append(
                [
                    name,
                    r,
                    rp.batch_size,
                    f"{busy:.3f}",
                    f"{wait:.3f}",
                    f"{rp.batch_size / busy:.2f}",
                    f"{solo_r:.2f}",
                    f"{rp.batch_size / busy / solo_r:.2f}",
                ]
            )
    print_table("cluster B: per rank, settled steps", rank_headers, rank_rows)
    print_table("cluster B: throughput after calibration settles", headers, rows)
    switch_headers = [
        "after step",
        "batches",
        "micro-batches",
        "re-plan + switch (s)",
        "predicted gain",
    ]
    switch_rows = [
        [
            r["step"],
            r["batches"],
            r["micro_batches"],
            f"{r['replan_s'] + r['seconds']:.2f}",
            f"{r['predicted_gain']:.1%}" if r["predicted_gain"] is not None else "—",
        ]
        for r in switches
    ]
    print_table("cluster B: re-plans of the calibrated job", switch_headers, switch_rows)
    cal_headers = [
        "after step",
        "per rank: compute measured / predicted",
        "per rank: step measured (s)",
        "per rank: peak measured / predicted (MiB)",
        "predicted gain",
        "decision",
    ]
    cal_rows = [
        [
            c["step"],
            " / ".join(
                f"{f['measured_compute_s'] / f['predicted_compute_s']:.2f}" for f in c["ranks"]
            ),
            " / ".join(f"{f['measured_step_s']:.3f}" for f in c["ranks"]),
            " / ".join(
                f"{f['measured_peak_bytes'] / 2**20:.1f} / {f['predicted_peak_bytes'] / 2**20:.1f}"
                for f in c["ranks"]
            ),
            f"{c['predicted_gain']:+.1%}" if c.get("predicted_gain") is not None else "—",
            "re-planned"
            if c.get("replanned")
            else "confirming"
            if c.get("confirming")
            else (c.get("why_not") or "kept"),
        ]
        for c in cals
    ]
    print_table("cluster B: calibrations", cal_headers, cal_rows)
    summary = [
        f"## Cluster B of hetero_throughput (`{spec}`), global batch {batch}",
        markdown_table(headers, rows, "lrrrl"),
        f"- calibrated >= 0.9 x ideal (measured next to it): {frac:.2f} x over steps {window[0]}-{window[-1]} "
        f"({len(window)} steps), re-planned after step(s) {[r['step'] for r in switches]}: "
        f"{outcome}",
        "- quiet-machine view (fastest settled step / the ranks' fastest solo rounds next to "
        "it, summed): " + ", ".join(f"{name} {v:.2f} x" for name, v in quiet.items()),
    ]
    details = [
        "## Cluster B: per rank over the settled steps",
        "Each rank's compute speed under its plan (batch / median compute seconds) against its "
        "solo speed in the ideal phases next to the job, and its median wait in collectives.",
        markdown_table(rank_headers, rank_rows, "lrrrrrrr"),
        "## Cluster B: re-plans of the calibrated job",
        markdown_table(switch_headers, switch_rows) if switch_rows else "None.",
        "## Cluster B: calibrations of the calibrated job",
        markdown_table(cal_headers, cal_rows),
        "## Cluster B: ideal bound's terms",
        "Solo samples per compute second per rank, per phase (before the first job | between "
        "| after the second): "
        + "; ".join(
            f"rank {r}: " + " | ".join(" ".join(f"{v:.2f}" for v in ph[r]["rates"]) for ph in solo)
            for r in range(world)
        ),
    ]
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name in jobs:
        st = steps_of(name)
        xs = sorted(k for k in st if k > 1)
        ax.plot(xs, [batch * SEQ_LEN / st[k] for k in xs], marker=".", label=name)
    ax.axhline(ideal_near["calibrated"], color="black", lw=1, label="ideal (next to calibrated)")
    ax.axhline(0.9 * ideal_near["calibrated"], color="black", ls="--", lw=1, label="0.9 x that")
    for r in switches:
        ax.axvline(r["step"] + 0.5, color="tab:orange", ls=":", lw=1)
    ax.set_xlabel("step (dotted: re-plan)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"cluster B ({spec}), B={batch}", fontsize=9)
    ax.legend(fontsize=8)
    fig_name = save_figure(fig, "calibration_cluster_b", note="emulated")
    return Section(
        summary, details, [fig_name], f"cluster B: two CPU ranks ({spec}), budgets enforced"
    )


SECTIONS: dict[str, Callable[[argparse.Namespace, object, Path], Section]] = {
    "drift": _drift,
    "cluster-b": _cluster_b,
}


if __name__ == "__main__":
    main()
