"""`cephalo demo`: the whole pipeline on four emulated devices of this machine's CPU.

    profile -> plan (cephalo vs baselines) -> short baseline run -> train under the cephalo plan
    -> a device throttles mid-run: the job calibrates, re-plans and switches (demo/throttle.py)
    -> report

The baseline (even plan) runs first and only for a few steps: its measured throughput is the
comparison, and its measured step time calibrates how many steps of the cephalo run fit the
time budget on this machine, whatever else is running on it.

Every step uses the public pieces a user would: the profiler and its local launcher, the
planner and its cost model, `cephalo run`'s elastic launcher with `cephalo train` workers, and
the metrics the workers write. Nothing is simulated except the devices themselves: a device
`cpu:slowdown=F` stretches its compute F times by sleeping, and `mem=SIZE` is a budget the
engine's memory ledger enforces (an allocation over it is an error, as on a real GPU).

The cluster is chosen so that memory matters: the last device is as slow as the third but has
only DEMO_TIGHT_MEMORY, too little for an even share of the training state plus the
activations of an even batch, so the even plan must micro-batch there (or, tighter, offload or
not fit at all) while the cephalo plan gives that device fewer samples and a smaller state shard.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from cephalo import envvars
from cephalo.costmodel.model import CostModel
from cephalo.costmodel.results import PlanEvaluation
from cephalo.costmodel.sources import measured_cost_model
from cephalo.demo.report import write_report
from cephalo.demo.result import (
    STRATEGIES,
    WARMUP_STEPS_EXCLUDED,
    DemoOptions,
    DemoResult,
    RunSummary,
    describe_cluster,
)
from cephalo.demo.throttle import (
    THROTTLE_RANK,
    read_throttle_run,
    throttle_job_config,
    throttle_summary,
    throttle_table,
)
from cephalo.errors import CephaloError, PlanDoesNotFit
from cephalo.planner.makers import make_plan
from cephalo.planner.plan import Plan
from cephalo.runtime.step_timing import PARTS as TIME_PARTS
from cephalo.runtime.step_timing import split_step
from cephalo.specs.cluster import Cluster
from cephalo.specs.profile import MeasuredProfiles
from cephalo.train.config import JobConfig
from cephalo.train.config_manager import config_to_toml
from cephalo.train.metrics import read_metrics
from cephalo.views.tables import make_console, plan_table, strategy_line

DEMO_TIGHT_MEMORY = "32MiB"
DEMO_DEVICES = f"cpu,cpu:slowdown=1.5,cpu:slowdown=3,cpu:slowdown=3,mem={DEMO_TIGHT_MEMORY}"
"""Four ranks: full speed, 1.5x and 3x slower, and a 3x slower one with little memory."""


# ----------------------------------------------------------------------------- the job
def demo_job_config(out: Path, quick: bool = False) -> JobConfig:
    """The demo's training job (configs/demo.toml holds the same job as a file)."""
    cfg = JobConfig()
    cfg.model.name = "gpt-tiny" if quick else "gpt-small-demo"
    cfg.model.overrides = {"dropout": 0.0}
    cfg.model.dtype = "fp32"
    cfg.data.seq_len = 32 if quick else 128
    cfg.data.val_fraction = 0.05
    t = cfg.train
    t.steps = 6 if quick else 80
    t.global_batch_size = 8 if quick else 16
    t.lr, t.min_lr, t.warmup_steps = 1e-3, 1e-4, 2 if quick else 8
    t.eval_every = 3 if quick else 20
    t.eval_batches = 2
    p = cfg.parallel
    p.plan = "auto"
    p.devices = DEMO_DEVICES
    p.backend = "gloo"
    p.timeout_s = 120.0
    cfg.checkpoint.every = 0  # only at the end: the demo measures training, not storage
    cfg.checkpoint.keep_last = 1
    cfg.checkpoint.resume = "never"
    cfg.logging.dir = str(out)
    cfg.logging.log_every = 1
    pr = cfg.profile
    pr.repeats, pr.warmup = (1, 0) if quick else (2, 1)
    pr.time_cap_s = 3.0 if quick else 10.0
    pr.max_micro_batch = 4 if quick else 8  # the plans use micro-batches up to ~B/2
    return cfg


# ----------------------------------------------------------------------------- 1. profile
def profile_cluster(
    cfg: JobConfig, cluster: Cluster, console: Console, in_process: bool = False
) -> MeasuredProfiles:
    """Measured profiles of the demo's device types and collectives (cached in `profile.cache`).

    Normally one rank per device (the profiler's local launcher), so the collectives between
    them are measured too. `in_process` measures the device types here, one thread, without
    starting ranks (no collective profile: the cost model uses the cluster's nominal links)."""
    from cephalo.profiling.profiler import cached_profiles

    model, seq_len, dtype = cfg.model.name, cfg.data.seq_len, cfg.model.dtype
    cache = str(cfg.profile_cache)
    hit = cached_profiles(
        model, seq_len, dtype, cluster, backend="gloo", cache=cache, **cfg.model.overrides
    )
    if hit is not None:
        return hit
    settings = cfg.profile
    if in_process:
        import torch

        from cephalo.profiling.profiler import profile_devices

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # what each of the job's ranks gets
        try:
            return profile_devices(
                model,
                seq_len,
                dtype,
                cluster,
                settings=settings,
                cache=cache,
                **cfg.model.overrides,
            )
        finally:
            torch.set_num_threads(threads)
    from cephalo.profiling.local import profile_local_ranks

    # profile_rank(comm, model, seq_len, dtype, devices, settings, cache, use_cache, refresh, overrides)
    rank_args = (
        model,
        seq_len,
        dtype,
        cfg.parallel.devices,
        settings,
        cache,
        True,
        False,
        dict(cfg.model.overrides),
    )
    result = profile_local_ranks(console, cluster, rank_args, timeout_s=600.0)
    return MeasuredProfiles.from_dict(result)


# ----------------------------------------------------------------------------- 2. plan
def make_plans(
    cost_model: CostModel, global_batch: int, model_name: str
) -> dict[str, Plan | PlanDoesNotFit]:

    plans: dict[str, Plan | PlanDoesNotFit] = {}
    for strategy in STRATEGIES:
        try:
            plans[strategy] = make_plan(cost_model, global_batch, strategy, model_name=model_name)
        except PlanDoesNotFit as e:
            if strategy == "cephalo":
                raise
            plans[strategy] = e
    return plans


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def memory_note(
    cost_model: CostModel, plans: dict[str, Plan | PlanDoesNotFit], global_batch: int
) -> str:
    """Why the smallest-memory device shapes the plans, in one paragraph, from the cost model."""
    n = len(cost_model.devices)
    tight = min(range(n), key=cost_model.capacity_bytes)
    cap = cost_model.capacity_bytes(tight)
    even_batch = math.ceil(global_batch / n)
    plain = cost_model.rank_cost(tight, even_batch, even_batch, 1.0 / n, offload=False)
    head = f"Rank {tight} ({cost_model.devices[tight].type_key}) has a {_mib(cap)} memory budget. "
    if plain.fits:
        head += (
            f"An even share of the state (1/{n}) plus the activations of {even_batch} samples needs "
            f"{_mib(plain.peak_bytes)}, which fits: memory does not constrain this cluster. "
        )
    else:
        head += (
            f"An even share of the state (1/{n}, {_mib(plain.memory.state)}) plus the activations of an "
            f"even batch of {even_batch} samples needs {_mib(plain.peak_bytes)}: it does not fit. "
        )
        even = plans.get("even")
        if isinstance(even, PlanDoesNotFit):
            head += "The even plan does not fit at all, not even with micro-batch 1 and offloaded activations. "
        elif isinstance(even, Plan):
            r = even.ranks[tight]
            how = f"{r.num_micro_batches} micro-batches ({r.micro_batches_text()})"
            head += (
                f"The even plan must run it as {how}"
                f"{' with its activations on the host' if r.offload_activations else ''}. "
            )
    ceph = plans["cephalo"]
    assert isinstance(ceph, Plan)
    r = ceph.ranks[tight]
    work = (
        f"{r.batch_size} sample(s) in micro-batches of {r.micro_batch_size}"
        if r.batch_size
        else "no samples (it only holds state)"
    )
    head += (
        f"The cephalo plan gives it {work} and {r.state_fraction:.3f} of the state"
        f"{', activations on the host' if r.offload_activations else ''}."
    )
    return head


def ideal_samples_per_s(cost_model: CostModel, global_batch: int) -> float:
    """Upper bound: every device computing at its best per-sample speed (any batch up to the
    global one), with no communication, no optimizer and perfect balance."""
    total = 0.0
    for d in cost_model.devices:
        best = min(
            float(cost_model.step_time_parts(d.type_key, b, b, False)[1]) / b
            for b in range(1, global_batch + 1)
        )
        total += 1.0 / best
    return total


def print_plans(
    console: Console,
    cost_model: CostModel,
    plans: dict[str, Plan | PlanDoesNotFit],
    evaluations: dict[str, PlanEvaluation],
) -> None:

    ceph = plans["cephalo"]
    assert isinstance(ceph, Plan)
    console.print(
        plan_table(
            ceph,
            evaluations["cephalo"],
            title="cephalo plan (predicted by the measured cost model)",
            memory_unit="MiB",
        )
    )
    for s in STRATEGIES:
        console.print(strategy_line(s, plans[s], plans["even"]), soft_wrap=True)


# ----------------------------------------------------------------------------- 3-4. train
def summarize_run(strategy: str, run_dir: Path, wall_s: float, global_batch: int) -> RunSummary:
    """Step times, losses and per-rank timings read back from a run's metrics.jsonl."""
    steps = read_metrics(run_dir / "metrics.jsonl", kind="step")
    if not steps:
        raise CephaloError(f"the {strategy} run wrote no metrics to {run_dir / 'metrics.jsonl'}")
    evals = read_metrics(run_dir / "metrics.jsonl", kind="eval")
    timed = steps[WARMUP_STEPS_EXCLUDED:] if len(steps) > WARMUP_STEPS_EXCLUDED + 1 else steps[-1:]
    step_s = statistics.median(r["step_s"] for r in timed)
    n = len(timed[0]["ranks"]["busy_s"])
    busy = [statistics.fmean(r["ranks"]["busy_s"][i] for r in timed) for i in range(n)]
    idle = [statistics.fmean(r["ranks"]["idle_s"][i] for r in timed) for i in range(n)]
    peak = [max(int(r["ranks"]["peak_bytes"][i]) for r in steps) for i in range(n)]
    split = [
        {
            part: statistics.fmean(_split_of(r["ranks"], i)[part] for r in timed)
            for part in TIME_PARTS
        }
        for i in range(n)
    ]
    return RunSummary(
        strategy=strategy,
        run_dir=run_dir,
        steps=len(steps),
        wall_s=wall_s,
        step_s=step_s,
        mean_step_s=statistics.fmean(r["step_s"] for r in timed),
        samples_per_s=global_batch / step_s,
        losses={int(r["step"]): float(r["loss"]) for r in steps},
        val_losses={int(r["step"]): float(r["val_loss"]) for r in evals},
        busy_s=busy,
        idle_s=idle,
        peak_bytes=peak,
        time_split=split,
    )


def _split_of(ranks: dict, i: int) -> dict[str, float]:
    """Rank i's step time split (runtime/step_timing.py) from a metrics record's `ranks`."""
    step_s = ranks.get("step_s", [0.0] * (i + 1))[i]
    stats = SimpleNamespace(
        busy_s=ranks["busy_s"][i],
        comm_wait_s=ranks["comm_wait_s"][i],
        optimizer_s=ranks.get("optimizer_s", [0.0] * (i + 1))[i],
        host_s=ranks.get("host_s", [0.0] * (i + 1))[i],
        step_s=step_s or ranks["busy_s"][i] + ranks["idle_s"][i],
    )
    return split_step(stats)


def launch_run(cfg: JobConfig, config_path: Path, quiet: bool) -> float:
    """`cephalo run --config config_path` (one `cephalo train` worker per device); wall seconds.

    quiet: the workers log warnings only (rank 0's progress bar still shows loss, speed and
    validation); otherwise every rank's start-up lines come too."""
    from cephalo.launch.elastic import run_elastic

    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(config_to_toml(cfg))
    started = time.perf_counter()
    env = {envvars.LOG_LEVEL: "WARNING"} if quiet else {}
    run_elastic(["--config", str(config_path)], devices=cfg.parallel.devices, env=env)
    return time.perf_counter() - started


def training_steps(
    options: DemoOptions,
    predicted_step_s: float,
    world_size: int,
    baseline: RunSummary | None = None,
    baseline_predicted_s: float | None = None,
) -> int:
    """Steps that fill the training budget.

    The cost model predicts each rank from per-device profiles; in the demo all ranks share the
    cores, with each other and with whatever else runs, which the profiles capture only in
    part. So the estimate is calibrated by the baseline run just measured on this machine:
    step = measured baseline step x (predicted cephalo / predicted baseline). Without a baseline,
    ranks per core scale the prediction."""
    if options.quick:
        return 6
    if baseline is not None and baseline_predicted_s:
        estimate = baseline.step_s * predicted_step_s / baseline_predicted_s
    else:
        estimate = predicted_step_s * max(1.0, world_size / (os.cpu_count() or 1))
    return int(min(400, max(20, options.minutes * 60.0 / estimate)))


# ----------------------------------------------------------------------------- the whole demo
def run_demo(options: DemoOptions, console: Console | None = None) -> DemoResult:
    """Profile, plan, train, compare, report. Returns what the report shows."""

    console = console or make_console()
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    timings: dict[str, float] = {}
    cfg = demo_job_config(out, options.quick)
    cluster = Cluster.parse(cfg.parallel.devices or DEMO_DEVICES)
    from cephalo.modeling.registry import build_model

    spec = build_model(cfg.model.name, **cfg.model.overrides).spec
    B = cfg.train.global_batch_size
    console.rule("[bold]cephalo demo")
    console.print(
        f"cluster: {describe_cluster(cluster)}  (emulated on this CPU: slowdown = compute stretched by "
        "sleeping, mem = a budget the memory ledger enforces)"
    )
    console.print(
        f"model: {spec.name} ({spec.total_params / 1e6:.2f}M parameters), seq {cfg.data.seq_len}, "
        f"global batch {B}, {cfg.model.dtype}, the bundled pydoc corpus (byte-level)"
    )

    console.rule("[bold]1/6 profile the devices")
    t0 = time.perf_counter()
    measured = profile_cluster(cfg, cluster, console, in_process=options.quick)
    timings["profile"] = time.perf_counter() - t0
    what = f"measured {', '.join(measured.measured)}" if measured.measured else "all from the cache"
    console.print(f"{what} in {timings['profile']:.1f} s (database {cfg.profile_cache})")
    if measured.comm is not None:
        console.print(
            f"collectives over {cluster.world_size} ranks: {measured.comm.bytes_per_s / 1e9:.2f} GB/s, "
            f"latency {measured.comm.latency_s * 1e3:.1f} ms"
        )

    console.rule("[bold]2/6 plan")
    t0 = time.perf_counter()
    cm = measured_cost_model(cluster, spec, cfg.data.seq_len, cfg.model.dtype, measured)
    plans = make_plans(cm, B, cfg.model.name)
    evaluations = {s: cm.evaluate(p) for s, p in plans.items() if isinstance(p, Plan)}
    timings["plan"] = time.perf_counter() - t0
    print_plans(console, cm, plans, evaluations)
    note = memory_note(cm, plans, B)
    console.print(note)
    plan_dir = out / "plans"
    plan_dir.mkdir(parents=True, exist_ok=True)
    for s, p in plans.items():
        if isinstance(p, Plan):
            p.to_json(plan_dir / f"{s}.json")
    comparison = next((s for s in ("even", "proportional") if isinstance(plans[s], Plan)), None)
    result = DemoResult(
        options=options,
        cluster=cluster,
        config=cfg,
        measured=measured,
        cost_model=cm,
        plans=plans,
        evaluations=evaluations,
        memory_note=note,
        ideal_samples_per_s=ideal_samples_per_s(cm, B),
        comparison=comparison,
        timings_s=timings,
    )

    ceph = plans["cephalo"]
    assert isinstance(ceph, Plan) and ceph.predicted is not None
    # on a terminal rank 0's progress bar tells the story; in a log file, its log lines do
    quiet = console.is_terminal
    baseline, baseline_predicted = None, None
    if comparison is None:
        console.rule("[bold]3/6 baseline")
        console.print("neither the even nor the proportional plan fits in memory: no baseline run")
    else:
        # The baseline runs first: its measured speed on this machine (shared cores, other
        # load) calibrates how many steps fit the cephalo run's time budget.
        base_plan = plans[comparison]
        assert isinstance(base_plan, Plan) and base_plan.predicted is not None
        base_steps = 3 if options.quick else options.baseline_steps
        console.rule(
            f"[bold]3/6 baseline: a short run under the {comparison} plan ({base_steps} steps)"
        )
        if comparison != "even":
            console.print(
                "the even plan does not fit in memory; the baseline is the proportional plan"
            )
        base_cfg = demo_job_config(out / comparison, options.quick)
        base_cfg.parallel.plan = str(plan_dir / f"{comparison}.json")
        base_cfg.train.steps = base_steps
        base_cfg.train.warmup_steps = 1
        base_cfg.train.eval_every = 0
        shutil.rmtree(out / comparison, ignore_errors=True)
        wall = launch_run(base_cfg, out / f"{comparison}.toml", quiet)
        timings[f"train {comparison}"] = wall
        baseline = result.runs[comparison] = summarize_run(comparison, out / comparison, wall, B)
        baseline_predicted = base_plan.predicted.step_s
        console.print(
            f"{comparison} plan: {baseline.step_s:.3f} s/step measured "
            f"(predicted {baseline_predicted:.3f} s/step)"
        )

    steps = training_steps(
        options, ceph.predicted.step_s, cluster.world_size, baseline, baseline_predicted
    )
    console.rule(f"[bold]4/6 train under the cephalo plan ({steps} steps)")
    run_cfg = demo_job_config(out / "cephalo", options.quick)
    run_cfg.parallel.plan = str(plan_dir / "cephalo.json")
    run_cfg.train.steps = steps
    run_cfg.train.eval_every = max(1, steps // 4)
    run_cfg.profile.cache = str(cfg.profile_cache)
    shutil.rmtree(out / "cephalo", ignore_errors=True)
    wall = launch_run(run_cfg, out / "cephalo.toml", quiet)
    timings["train cephalo"] = wall
    result.runs["cephalo"] = summarize_run("cephalo", out / "cephalo", wall, B)

    t_cfg = throttle_job_config(cfg, out / "replan", options.quick)
    console.rule(
        f"[bold]5/6 the plan corrects itself: rank {THROTTLE_RANK} throttles mid-run "
        f"({t_cfg.train.steps} steps, calibrating every {t_cfg.parallel.calibrate_every})"
    )
    shutil.rmtree(out / "replan", ignore_errors=True)
    wall = launch_run(t_cfg, out / "replan.toml", quiet)
    timings["train replan"] = wall
    result.throttle = read_throttle_run(t_cfg, wall)
    console.print(throttle_table(result.throttle))
    console.print(throttle_summary(result.throttle))

    console.rule("[bold]6/6 report")
    timings["total"] = time.perf_counter() - started
    report = write_report(result)
    _print_summary(console, result, report)
    return result


def _print_summary(console: Console, result: DemoResult, report: Path) -> None:
    ceph = result.runs["cephalo"]
    console.print(
        f"cephalo plan: {ceph.samples_per_s:.2f} samples/s measured ({ceph.step_s:.3f} s/step)"
    )
    if result.comparison and result.comparison in result.runs:
        base = result.runs[result.comparison]
        console.print(
            f"{result.comparison} plan: {base.samples_per_s:.2f} samples/s measured "
            f"({base.step_s:.3f} s/step): cephalo is [bold]{ceph.samples_per_s / base.samples_per_s:.2f}x"
            f"[/bold] {result.comparison}"
        )
    last = max(ceph.losses)
    val = (
        f", validation loss {ceph.val_losses[max(ceph.val_losses)]:.3f}" if ceph.val_losses else ""
    )
    console.print(
        f"loss {ceph.losses[min(ceph.losses)]:.3f} at step 1 -> {ceph.losses[last]:.3f} at step {last}{val}"
    )
    if result.throttle is not None:
        console.print(f"re-planning run: {throttle_summary(result.throttle)}")
    console.print(f"demo took {result.timings_s['total']:.0f} s; report: [bold]{report}[/bold]")
