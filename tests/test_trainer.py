"""The trainer in one process: schedule, metrics, run directory, resume, non-finite steps,
plan resolution, and the HF GPT-2 round trip through `cephalo export`."""

from __future__ import annotations

import json
import logging
import math
import shutil

import pytest
import torch

from cephalo.cli import main as cli_main
from cephalo.errors import CephaloError
from cephalo.planner.makers import manual_plan, simple_plan
from cephalo.planner.plan import Plan
from cephalo.specs.cluster import Cluster
from cephalo.train.config_manager import load_config
from cephalo.train.discovery import cluster_from_descriptions, describe_own_device
from cephalo.train.lr import LRSchedule
from cephalo.train.metrics import read_metrics, truncate_metrics
from cephalo.train.trainer import resolve_plan, train


def tiny_config(tmp_path, *extra: str):
    return load_config(
        None,
        [
            f"--logging.dir={tmp_path / 'run'}",
            "--logging.progress=false",
            "--model.name=gpt-tiny",
            "--data.seq_len=16",
            "--train.global_batch_size=4",
            "--train.steps=6",
            "--train.warmup_steps=2",
            "--train.eval_every=3",
            "--train.eval_batches=2",
            "--train.lr=1e-2",
            "--train.min_lr=1e-3",
            "--parallel.plan=even",
            "--checkpoint.every=3",
            *extra,
        ],
    )


# ----------------------------------------------------------------------------- lr schedule
def test_lr_warmup_then_cosine_to_min():
    s = LRSchedule(peak_lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=20)
    assert [s(i) for i in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert s(19) == pytest.approx(0.1)
    decay = [s(i) for i in range(3, 20)]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))
    assert s(11.5) == pytest.approx(0.55)  # halfway through the decay: the midpoint


def test_lr_constant_and_bad_input():
    s = LRSchedule(1e-3, 1e-4, 0, 5, kind="constant")
    assert [s(i) for i in range(5)] == [1e-3] * 5
    with pytest.raises(CephaloError, match="warmup_steps"):
        LRSchedule(1.0, 0.1, 5, 5)
    with pytest.raises(CephaloError, match="min_lr"):
        LRSchedule(1.0, 2.0, 0, 5)


# ----------------------------------------------------------------------------- plans
def test_simple_plans_split_by_speed():
    cluster = Cluster.parse("cpu,cpu:slowdown=2,cpu:slowdown=4")
    prop = simple_plan("proportional", cluster, "gpt-tiny", 16, 14, "fp32")
    assert prop.batch_sizes == [8, 4, 2]
    even = simple_plan("even", cluster, "gpt-tiny", 16, 8, "fp32")
    assert even.batch_sizes == [3, 3, 2]
    assert sum(even.state_fractions) == pytest.approx(1.0)
    even.validate(world_size=3, model="gpt-tiny")


def test_plan_file_is_checked_against_the_job(tmp_path):
    path = tmp_path / "plan.json"
    simple_plan("even", Cluster.parse("cpu,cpu"), "gpt-tiny", 16, 4, "fp32").to_json(path)
    cfg = tiny_config(tmp_path, f"--parallel.plan={path}")
    assert resolve_plan(cfg, Cluster.parse("cpu,cpu"), 2).batch_sizes == [2, 2]
    with pytest.raises(CephaloError, match="the plan is for 2 ranks but the job has 3"):
        resolve_plan(cfg, Cluster.parse("cpu,cpu,cpu"), 3)
    with pytest.raises(CephaloError, match="global batch of 4"):
        resolve_plan(
            tiny_config(tmp_path, f"--parallel.plan={path}", "--train.global_batch_size=6"),
            Cluster.parse("cpu,cpu"),
            2,
        )


def test_plan_file_meets_the_devices_that_came_up(tmp_path):
    """A plan file made for `cpu,cpu:slowdown=3`: started in the other order each rank gets
    the rank-plan made for its device; on other devices it is refused before any engine."""
    path = tmp_path / "plan.json"
    made = Cluster.parse("cpu,cpu:slowdown=3,mem=24MiB")
    plan = manual_plan("gpt-tiny", 16, [3, 1], [3, 1], [0.9, 0.1], ["cpu", "cpu:slowdown=3"])
    plan.meta["cluster"] = made.to_dict()
    plan.to_json(path)
    cfg = tiny_config(tmp_path, f"--parallel.plan={path}")
    assert resolve_plan(cfg, made, 2).state_fractions == [0.9, 0.1]
    swapped = resolve_plan(cfg, Cluster.parse("cpu:slowdown=3,mem=24MiB,cpu"), 2)
    assert swapped.state_fractions == [0.1, 0.9] and swapped.batch_sizes == [1, 3]
    assert [r.device for r in swapped.ranks] == ["cpu:slowdown=3", "cpu"]
    with pytest.raises(CephaloError, match=r"rank 1 is a cpu:slowdown=3 \(4 GiB\) but the plan's"):
        resolve_plan(cfg, Cluster.parse("cpu,cpu:slowdown=3"), 2)


def test_devices_must_match_world_size(tmp_path):
    cfg = tiny_config(tmp_path, "--parallel.devices=cpu,cpu:slowdown=2")
    mine = [describe_own_device(cfg, rank, 2) for rank in range(2)]
    assert [d.slowdown for d in cluster_from_descriptions(mine).devices] == [1.0, 2.0]
    with pytest.raises(CephaloError, match="lists 2 device"):
        describe_own_device(cfg, 0, 3)


def test_sequence_longer_than_the_model_is_an_error(tmp_path):
    with pytest.raises(CephaloError, match="data.seq_len = 64 is longer"):
        train(tiny_config(tmp_path, "--data.seq_len=64"))


def test_dpo_on_data_that_is_not_pairs_is_refused_before_any_step(tmp_path):
    """`train.objective = "dpo"` with text data: one message, before any step (issue 42;
    the reverse, preference data under `sft`, is tests/test_dpo.py's)."""
    with pytest.raises(CephaloError, match='"dpo" needs preference data'):
        train(tiny_config(tmp_path, "--train.objective=dpo"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- a run
def test_run_writes_metrics_config_plan_and_checkpoints(tmp_path):
    cfg = tiny_config(tmp_path)
    result = train(cfg)
    run = tmp_path / "run"
    assert sorted(result.losses) == list(range(1, 7))
    assert all(math.isfinite(v) for v in result.losses.values())
    assert sorted(result.val_losses) == [3, 6]
    steps = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in steps] == list(range(1, 7))
    first = steps[0]
    assert first["loss"] == pytest.approx(result.losses[1])
    assert first["lr"] == pytest.approx(cfg.train.lr / 2)  # warmup step 1 of 2
    assert first["tokens"] == 4 * 16 and first["tokens_per_s"] > 0 and first["grad_norm"] > 0
    assert set(first["ranks"]) == {
        "busy_s",
        "comm_wait_s",
        "idle_s",
        "peak_bytes",
        "optimizer_s",
        "host_s",
        "step_s",
    }
    assert len(first["ranks"]["peak_bytes"]) == 1 and first["ranks"]["peak_bytes"][0] > 0
    evals = read_metrics(run / "metrics.jsonl", kind="eval")
    assert [r["step"] for r in evals] == [3, 6]
    assert load_config(run / "config.toml").to_dict() == cfg.to_dict()
    assert Plan.from_json(run / "plan.json").batch_sizes == [4]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000003", "step_000006"]
    # the loss falls: the model learns something within a few steps
    assert result.losses[6] < result.losses[1]


def test_resume_continues_the_exact_trajectory(tmp_path, caplog):
    cfg = tiny_config(tmp_path)
    full = train(cfg)
    run = tmp_path / "run"
    # lose the last checkpoint, as if the job had died after step 3
    shutil.rmtree(run / "checkpoints" / "step_000006")
    resumed = train(tiny_config(tmp_path))
    assert resumed.start_step == 3
    assert sorted(resumed.losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed.losses[step] == full.losses[step]
    assert resumed.val_losses[6] == full.val_losses[6]
    # the metrics of the re-run steps replace the old ones instead of repeating them
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, 7))
    # resuming a finished run does nothing, and says so in one line (issue 41, point 8)
    with caplog.at_level(logging.INFO, logger="cephalo"):
        again = train(tiny_config(tmp_path))
    assert again.start_step == 6 and again.losses == {}
    said = [m for m in caplog.messages if m.startswith("nothing to train")]
    assert len(said) == 1 and "is at step 6 and train.steps = 6" in said[0]
    assert "--train.steps 12" in said[0]


def test_truncate_metrics_keeps_earlier_records(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(
        "".join(json.dumps({"kind": "step", "step": s}) + "\n" for s in range(1, 6))
        + '{"kind": "st'
    )
    truncate_metrics(path, 3)  # the cut-off last line of a killed job is dropped too
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_nonfinite_steps_are_skipped_then_stop_with_a_checkpoint(tmp_path):
    # an absurd learning rate: step 1's update overflows the weights, every later loss is NaN
    cfg = tiny_config(
        tmp_path,
        "--train.max_nonfinite_skips=3",
        "--train.steps=10",
        "--train.eval_every=0",
        "--train.warmup_steps=0",
        "--train.lr=1e30",
        "--train.min_lr=1e30",
        "--train.grad_clip=0",
        "--checkpoint.every=0",
    )
    with pytest.raises(CephaloError, match="not finite for 4 steps in a row"):
        train(cfg)
    steps = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["skipped"] for r in steps] == [False, True, True, True, True]
    assert steps[-1]["loss"] == "nan"
    assert (tmp_path / "run" / "checkpoints" / "step_000005").is_dir()


# ----------------------------------------------------------------------------- HF round trip
def test_hf_gpt2_trains_and_exports_to_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from cephalo.modeling.registry import build_model

    run = tmp_path / "hf"
    rc = cli_main(
        [
            "train",
            "--model.name=hf-gpt2-tiny",
            f"--logging.dir={run}",
            "--logging.progress=false",
            "--data.seq_len=32",
            "--train.steps=3",
            "--train.warmup_steps=1",
            "--train.global_batch_size=4",
            "--train.eval_every=0",
            "--parallel.plan=even",
        ]
    )
    assert rc == 0
    out = tmp_path / "w.safetensors"
    assert (
        cli_main(["export", str(run), "--out", str(out), "--hf", str(tmp_path / "hf-model")]) == 0
    )
    state = load_file(str(out))

    # our model with the exported weights, run unit by unit
    model = build_model("hf-gpt2-tiny").materialize("cpu", torch.Generator().manual_seed(123))
    with torch.no_grad():
        for unit, name, p in model.named_unit_parameters():
            p.copy_(state[f"{unit}.{name}"])
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        h = model.units[0].module(x)
        for u in model.units[1:-1]:
            h = u.module(h)
        ours = model.units[-1].module.logits(h)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf-model")).eval()
        theirs = hf(x).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5), (ours - theirs).abs().max()
    # and the trained weights are not the initial ones (the export carries the training)
    init = build_model("hf-gpt2-tiny").materialize("cpu", torch.Generator().manual_seed(0))
    first = next(iter(init.named_unit_parameters()))
    assert not torch.equal(state[f"{first[0]}.{first[1]}"], first[2].detach())


@pytest.mark.slow
def test_auto_plan_profiles_then_plans(tmp_path):
    pytest.importorskip("cephalo.profiling")
    cfg = tiny_config(
        tmp_path,
        "--parallel.plan=auto",
        "--train.steps=2",
        "--train.warmup_steps=1",
        "--train.eval_every=0",
        "--profile.repeats=1",
        "--profile.warmup=0",
        "--profile.time_cap_s=1",
    )
    result = train(cfg)
    assert result.plan.strategy == "cephalo" and result.plan.batch_sizes == [4]
    assert result.plan.meta["profiles"]["measured"] == ["cpu"]
    assert (tmp_path / "run" / "profile.json").is_file()
    # the second run finds the device in the profile database instead of measuring again
    again = train(
        tiny_config(
            tmp_path,
            "--parallel.plan=auto",
            "--train.steps=2",
            "--train.warmup_steps=1",
            "--train.eval_every=0",
            "--checkpoint.resume=never",
        )
    )
    assert (
        again.plan.meta["profiles"]["cached"] == ["cpu"]
        and again.plan.meta["profiles"]["measured"] == []
    )


def test_epochs_become_steps(tmp_path):
    """Issue 41, point 10: `train.epochs` instead of `train.steps`: ceil(epochs x steps per
    epoch), the steps of one epoch being the data's windows of seq_len + 1 tokens divided by
    the global batch (1000 bytes -> 58 windows of 17 -> 14 steps at batch 4)."""
    from cephalo.train.config import steps_for_epochs

    assert [steps_for_epochs(e, 14) for e in (0.25, 0.5, 1, 3 / 14, 2)] == [4, 7, 14, 3, 28]
    with pytest.raises(CephaloError, match="less than one global batch"):
        steps_for_epochs(1, 0)
    with pytest.raises(CephaloError, match="both set: keep one of the two"):
        tiny_config(tmp_path, "--train.epochs=1")  # tiny_config sets train.steps
    data = tmp_path / "small.txt"
    data.write_text(("abcdefgh " * 112)[:1000])
    cfg = tiny_config(
        tmp_path, f"--data.path={data}", "--data.val_fraction=0", "--train.eval_every=0"
    )
    cfg.train.steps, cfg.train.epochs = 100, 0.25  # the default steps: unset
    cfg.validate()
    result = train(cfg)
    expected = math.ceil(0.25 * ((1000 // 17) // 4))
    assert sorted(result.losses) == list(range(1, expected + 1))


def test_one_metrics_record_feeds_every_tracker(tmp_path, monkeypatch):
    """Issue 41, point 10: each metrics.jsonl record's scalars (`scalars_of`) reach every
    tracker asked for, the same values in the same order (MLflow and trackio stand-ins record
    what they get: no server here); a W&B run in offline mode writes its run file."""
    import importlib.util

    from cephalo.train import metrics

    got: list = []

    class Recorder:
        def __init__(self, s):
            got.append(("init", s.project, s.run_name, s.config["train"]["steps"]))

        def log(self, values, step):
            got.append((step, values))

        def close(self):
            got.append("close")

    monkeypatch.setitem(metrics._SINKS, "mlflow", Recorder)
    monkeypatch.setitem(metrics._SINKS, "trackio", Recorder)
    monkeypatch.setattr(metrics, "require_trackers", lambda names: None)
    has_wandb = importlib.util.find_spec("wandb") is not None
    extra = ["--logging.mlflow=true", "--logging.trackio=true", "--logging.project=p"]
    extra += ["--train.steps=3", "--train.eval_every=3", "--checkpoint.every=0"]
    if has_wandb:
        extra += ["--logging.wandb=true", "--logging.offline=true"]
    result = train(tiny_config(tmp_path, *extra))
    records = read_metrics(tmp_path / "run" / "metrics.jsonl", kind=None)
    expected = [(r["step"], metrics.scalars_of(r)) for r in records if metrics.scalars_of(r)]
    assert got[:2] == [("init", "p", "run", 3)] * 2
    assert got[2:-2] == [e for e in expected for _ in range(2)]  # each record, both sinks
    assert got[-2:] == ["close", "close"]
    by_step = dict(expected[:3])
    assert [by_step[s]["train/loss"] for s in (1, 2, 3)] == [result.losses[s] for s in (1, 2, 3)]
    assert expected[3] == (3, {"val/loss": result.val_losses[3]})
    assert {"train/lr", "train/grad_norm", "rank0/step_s", "rank0/peak_bytes"} <= set(by_step[1])
    if has_wandb:
        runs = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
        assert len(runs) == 1 and runs[0].stat().st_size > 0
