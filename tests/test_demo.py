"""`cephalo demo` end to end (quick mode), its config, its step budget; the example configs
train; `parallel.max_restarts` / `profile.max_micro_batch`."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import pytest

from cephalo.demo.pipeline import demo_job_config, training_steps
from cephalo.demo.result import DemoOptions, RunSummary
from cephalo.errors import CephaloError, PlanDoesNotFit
from cephalo.planner.plan import Plan
from cephalo.specs.cluster import Cluster
from cephalo.train.config_manager import load_config
from cephalo.train.metrics import read_metrics
from cephalo.train.trainer import train
from procs import run_tagged

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (REPO / "configs").glob("*.toml") if "[model]" in p.read_text())
"""The example job configs (configs/ also holds other TOML files, e.g. the advisor's offers)."""
PLACEHOLDER_MODELS = {"Qwen2.5-0.5B": ("qwen2", 32768)}
"""Model directories the example configs name but no test machine has (nothing is ever
downloaded): the family and context of a tiny stand-in of the same config."""


CHAT_EXAMPLE = "data/chat-example/qwen-tiny"
"""configs/chat-finetune.toml's model: written by scripts/make_chat_example.py (README)."""
PREFERENCE_EXAMPLE = "data/preference-example/qwen-tiny"
"""configs/dpo.toml's model: written by scripts/make_preference_example.py (README)."""


def _stand_in(cfg, tmp_path: Path) -> None:
    """A config naming a model directory this machine lacks trains a tiny random model of
    the same family and context instead, on the bundled corpus (byte tokenizer: 256 ids);
    the chat and preference examples' models and data are written as the README does,
    smaller."""
    if cfg.model.name == CHAT_EXAMPLE:
        from cephalo.data.chat_example import write_chat_example

        example = write_chat_example(tmp_path / "chat-example", conversations=80)
        cfg.model.name, cfg.data.path = str(example.model), str(example.jsonl)
        return
    if cfg.model.name == PREFERENCE_EXAMPLE:
        from cephalo.preference.example import write_preference_example

        example = write_preference_example(tmp_path / "preference-example", pairs=80)
        cfg.model.name, cfg.data.path = str(example.model), str(example.jsonl)
        return
    if cfg.model.name not in PLACEHOLDER_MODELS:
        return
    from hf_configs import save_tiny_model

    family, context = PLACEHOLDER_MODELS[cfg.model.name]
    directory = tmp_path / cfg.model.name
    if not directory.is_dir():
        save_tiny_model(family, directory, max_position_embeddings=context, vocab_size=256)
    cfg.model.name = str(directory)
    cfg.data.path = None


# ----------------------------------------------------------------------------- the demo itself
@pytest.mark.slow
def test_quick_demo_writes_the_report(tmp_path):
    out = tmp_path / "demo"
    env = {**os.environ, "CEPHALO_LOG": "WARNING"}
    proc = run_tagged(
        [sys.executable, "-m", "cephalo", "demo", "--quick", "--out", str(out)],
        timeout_s=240,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"report: {out / 'report.md'}" in " ".join(proc.stdout.split())
    for png in ("loss.png", "ranks.png", "throughput.png", "plan.png"):
        assert (out / png).stat().st_size > 5000, png
    report = (out / "report.md").read_text()
    # the plan table: one row per emulated device, rank 3 with its 32 MiB budget
    rows = re.findall(r"^\| (\d) \| (cpu[^|]*) \| (\d+) MiB \| (\d+) \|", report, flags=re.M)
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert rows[3][1].strip() == "cpu:slowdown=3" and rows[3][2] == "32"
    assert sum(int(r[3]) for r in rows) == demo_job_config(out, quick=True).train.global_batch_size
    # measured numbers for both runs, and the speedup read off them
    measured = {
        m[0]: float(m[1])
        for m in re.findall(
            r"^\| (cephalo|even) \| [\d.]+ \| [\d.]+ \| [^|]+ \| "
            r"[\d.]+ \| ([\d.]+) \|",
            report,
            flags=re.M,
        )
    }
    assert set(measured) == {"cephalo", "even"} and all(v > 0 for v in measured.values())
    speedup = float(re.search(r"over the even plan: ([\d.]+)x", report).group(1))
    assert speedup == pytest.approx(measured["cephalo"] / measured["even"], rel=0.02)
    assert "devices are emulated" in report
    # the runs behind it: metrics with per-rank timings, the planned batches
    steps = read_metrics(out / "cephalo" / "metrics.jsonl")
    assert len(steps) == 6 and len(steps[0]["ranks"]["busy_s"]) == 4
    assert (out / "plans" / "cephalo.json").is_file() and (out / "profile.json").is_file()
    # the re-planning run: its own plan, a throttled rank, a row per calibration read back
    # from its metrics (whether the tiny model's throttling leads to a switch is not asserted:
    # its compute is small next to the collectives on a shared machine)
    assert "## The plan corrects itself" in report
    assert (out / "replan.png").stat().st_size > 5000
    replan_cfg = load_config(out / "replan.toml")
    assert replan_cfg.parallel.plan == "auto" and replan_cfg.parallel.emulate_drift == "5:0:4"
    calibrations = read_metrics(out / "replan" / "metrics.jsonl", kind="calibration")
    assert [c["step"] for c in calibrations][:2] == [2, 4]  # calibrate_after = every = 2
    rows = re.findall(
        r"^\| (\d+) \| [-\d. ]+ \| [^|]+ \| (kept|confirming|re-planned) \|", report, flags=re.M
    )
    assert [int(r[0]) for r in rows] == [c["step"] for c in calibrations]
    switched = [c["step"] for c in calibrations if c["replanned"]]
    assert [int(r[0]) for r in rows if r[1] == "re-planned"] == switched
    for step in switched:  # a switch is confirmed: the calibration before it saw the gain
        assert next(c for c in calibrations if c["step"] == step - 2)["confirming"]


# ----------------------------------------------------------------------------- config and budget
def test_configs_demo_toml_is_the_demo_job():
    assert (
        load_config(REPO / "configs" / "demo.toml").to_dict()
        == demo_job_config(Path("runs/demo")).to_dict()
    )


def _baseline(step_s: float) -> RunSummary:
    return RunSummary(
        strategy="even",
        run_dir=Path("."),
        steps=10,
        wall_s=1.0,
        step_s=step_s,
        mean_step_s=step_s,
        samples_per_s=16 / step_s,
    )


def test_training_steps_are_calibrated_by_the_measured_baseline():
    options = DemoOptions(minutes=1.0)
    # predicted cephalo 0.5 s, predicted even 1.0 s, measured even 2.0 s -> about 1.0 s per step here
    assert training_steps(options, 0.5, 4, _baseline(2.0), 1.0) == 60
    # a busier machine (slower baseline) gets fewer steps for the same budget
    assert training_steps(options, 0.5, 4, _baseline(4.0), 1.0) == 30
    # without a baseline: the prediction scaled by ranks per core
    cores = os.cpu_count() or 1
    assert training_steps(options, 0.5, 4) == int(
        min(400, max(20, 60 / (0.5 * max(1.0, 4 / cores))))
    )
    assert training_steps(DemoOptions(quick=True), 0.5, 4) == 6


def test_demo_rejects_a_bad_budget(tmp_path):
    from cephalo.commands.demo import run

    with pytest.raises(CephaloError, match="--minutes"):
        run(argparse.Namespace(out=str(tmp_path), minutes=-1.0, quick=False))


# ----------------------------------------------------------------------------- example configs
@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_example_config_trains_two_steps_in_one_process(path, tmp_path):
    cfg = load_config(
        path,
        [
            f"--logging.dir={tmp_path / 'run'}",
            "--logging.progress=false",
            # logging.tensorboard as the file says: an example must run after the README's
            # install, which has no tensorboard (the `tensorboard` extra)
            "--train.steps=2",
            "--train.warmup_steps=1",
            "--train.eval_every=2",
            "--train.eval_batches=1",
            "--train.global_batch_size=2",
            "--parallel.plan=even",
            "--checkpoint.every=0",
        ],
    )
    cfg.parallel.devices = None  # one process (the configs name multi-rank clusters)
    _stand_in(cfg, tmp_path)
    if cfg.model.name.endswith("Qwen2.5-0.5B"):
        cfg.data.seq_len = 64
    if cfg.model.name == "gpt2-124m":
        # the same config on a model small enough for a unit test (only the width and depth change)
        cfg.model.overrides = {**cfg.model.overrides, "n_layer": 1, "n_embd": 64, "n_head": 2}
        cfg.data.seq_len = 64
    result = train(cfg)
    assert result.final_step == 2 and len(result.losses) == 2
    assert all(v == v and v < 20 for v in result.losses.values())  # finite
    assert result.val_losses and (tmp_path / "run" / "config.toml").is_file()


def test_example_configs_fit_their_models_context(tmp_path):
    from cephalo.train.trainer import build_job_model

    for path in CONFIGS:
        cfg = load_config(path)
        _stand_in(cfg, tmp_path)
        # raises CephaloError if data.seq_len is longer than the model's context
        build_job_model(cfg)


# ----------------------------------------------------------------------------- config fields
def test_max_restarts_and_max_micro_batch_are_checked():
    assert load_config(None, ["--parallel.max_restarts=2"]).parallel.max_restarts == 2
    assert load_config(None, ["--profile.max_micro_batch=4"]).profile.max_micro_batch == 4
    with pytest.raises(CephaloError, match="parallel.max_restarts must be >= 0"):
        load_config(None, ["--parallel.max_restarts=-1"])
    with pytest.raises(CephaloError, match="profile.max_micro_batch must be >= 1"):
        load_config(None, ["--profile.max_micro_batch=0"])


@pytest.mark.parametrize(("argv", "expected"), [([], 3), (["--max-restarts", "1"], 1)])
def test_cephalo_run_takes_max_restarts_from_the_config(argv, expected, monkeypatch):
    import cephalo.launch.elastic
    from cephalo.cli import main

    seen = {}
    monkeypatch.setattr(cephalo.launch.elastic, "run_elastic", lambda *a, **kw: seen.update(kw))
    assert main(["run", "--nproc", "2", "--parallel.max_restarts=3", *argv]) == 0
    assert seen["max_restarts"] == expected


# ----------------------------------------------------------------------------- plans and their story
@pytest.fixture(scope="module")
def tiny_profiles():
    import torch

    from cephalo.profiling.profiler import profile_devices
    from cephalo.profiling.settings import ProfileSettings

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return profile_devices(
            "gpt-tiny",
            32,
            "fp32",
            Cluster.parse("cpu,cpu:slowdown=2"),
            use_cache=False,
            settings=ProfileSettings(repeats=1, warmup=0, max_micro_batch=4, time_cap_s=2),
        )
    finally:
        torch.set_num_threads(threads)


def _plans_for(profiles, memory: str):
    from cephalo.costmodel.sources import measured_cost_model
    from cephalo.demo.pipeline import make_plans
    from cephalo.modeling.registry import build_model

    cm = measured_cost_model(
        Cluster.parse(f"cpu,cpu:slowdown=2,mem={memory}"),
        build_model("gpt-tiny").spec,
        32,
        "fp32",
        profiles,
    )
    return cm, make_plans(cm, 8, "gpt-tiny")


def test_memory_note_says_whether_memory_shapes_the_plans(tiny_profiles):
    from cephalo.demo.pipeline import memory_note

    cm, plans = _plans_for(tiny_profiles, "1GiB")
    assert "which fits: memory does not constrain" in memory_note(cm, plans, 8)
    # the smallest budget where an even share + 4 samples of activations no longer fit, but
    # micro-batching does: the note says how the even plan copes, from the plan itself
    plain = cm.rank_cost(1, 4, 4, 0.5)
    needed = plain.peak_bytes - plain.memory.reserve  # the reserve is a fraction of the budget (5%)
    cm, plans = _plans_for(tiny_profiles, f"{int(needed / 0.96)}B")
    even = plans["even"]
    assert isinstance(even, Plan) and even.ranks[1].micro_batch_size < 4
    note = memory_note(cm, plans, 8)
    assert "it does not fit" in note and f"{even.ranks[1].num_micro_batches} micro-batches" in note
    # below even's smallest option (micro-batch 1, activations on the host): only cephalo fits
    least = cm.rank_cost(1, 4, 1, 0.5, offload=True)
    cm, plans = _plans_for(
        tiny_profiles, f"{int((least.peak_bytes - least.memory.reserve) / 0.96)}B"
    )
    assert isinstance(plans["even"], PlanDoesNotFit) and isinstance(plans["cephalo"], Plan)
    assert "does not fit at all" in memory_note(cm, plans, 8)


def test_ideal_bound_is_above_every_plan(tiny_profiles):
    from cephalo.demo.pipeline import ideal_samples_per_s

    cm, plans = _plans_for(tiny_profiles, "1GiB")
    ideal = ideal_samples_per_s(cm, 8)
    assert all(p.predicted.samples_per_s <= ideal for p in plans.values() if isinstance(p, Plan))


def test_summarize_run_leaves_out_warmup_steps(tmp_path):
    import json

    from cephalo.demo.pipeline import summarize_run
    from cephalo.demo.result import WARMUP_STEPS_EXCLUDED

    times = [5.0, 4.0, 1.0, 2.0, 3.0]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for i, t in enumerate(times):
            ranks = {
                "busy_s": [t / 2, t / 4],
                "idle_s": [t / 2, 3 * t / 4],
                "comm_wait_s": [0, 0],
                "peak_bytes": [100 * (i + 1), 50],
            }
            f.write(
                json.dumps(
                    {"kind": "step", "step": i + 1, "loss": 5.0 - i, "step_s": t, "ranks": ranks}
                )
                + "\n"
            )
        f.write(json.dumps({"kind": "eval", "step": 5, "val_loss": 1.5}) + "\n")
    run = summarize_run("even", tmp_path, 10.0, global_batch=8)
    timed = times[WARMUP_STEPS_EXCLUDED:]
    assert run.step_s == sorted(timed)[len(timed) // 2] and run.samples_per_s == 8 / run.step_s
    assert run.busy_s[0] + run.idle_s[0] == pytest.approx(run.mean_step_s)
    assert run.peak_bytes == [500, 50] and run.val_losses == {5: 1.5} and run.losses[5] == 1.0


def test_throttle_summary_counts_the_switch_after_the_throttling(tmp_path):
    """A loaded machine can make the job re-plan before the throttling too: the summary's
    'after the re-plan' is measured from the switch that answered the throttling."""
    from cephalo.demo.result import CalibrationEvent, ThrottleRun
    from cephalo.demo.throttle import throttle_summary

    def event(step, decision):
        return CalibrationEvent(step, [1.0], [1.0], 0.2, decision, "", [4])

    run = ThrottleRun(tmp_path, 0, 9, 4.0, 1.0)
    run.step_s = {k: 0.5 if k < 9 else (2.0 if k <= 16 else 0.6) for k in range(1, 25)}
    run.events = [event(8, "re-planned"), event(12, "confirming"), event(16, "re-planned")]
    text = throttle_summary(run)
    assert "0.500 s before the throttling" in text, text
    assert "2.000 s throttled under the old plan" in text, text
    assert "0.600 s after the re-plan (switched after step 16" in text, text
    assert "also re-planned after step 8, before the throttling" in text, text
    run.events = [event(8, "re-planned")]
    assert throttle_summary(run).startswith("no re-plan after the throttling"), throttle_summary(
        run
    )
